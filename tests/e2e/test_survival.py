"""Runs that survive: SIGKILL + resume is bit-identical, signals checkpoint and exit cleanly,
a dead worker stops the run when healing is off (healing: tests/e2e/test_healing.py), no
process is left behind; a live run's directory refuses a second writer, a run stopped before
saving anything starts again in place, a finished run goes on to more steps (tests/test_rundir.py:
the same without runs)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from xrlhf.checkpoint import WARMUP, checkpoint_problem, checkpoint_step, list_checkpoints, resume_checkpoint
from xrlhf.rundir import RESUME, RunLock, check_output_dir
from xrlhf.runner import run
from xrlhf.validation import load_config, validate_dict
from xrlhf.utils.errors import UserError

from tests.conftest import two_ranks

pytestmark = pytest.mark.usefixtures("ray_session")  # runs handles in this process



@pytest.fixture()
def survival_config(base_config) -> dict:
    base_config["trainer"] = {"steps": 5, "prompts_per_step": 16, "eval_every": 2}
    base_config["checkpoint"] = {"every": 2, "keep": 2}
    base_config["warmup"] = {"steps": 2, "batch_size": 16}
    base_config["logging"] = {"tensorboard": False}
    return base_config


def start(config: dict, tmp_path: Path, out: Path, *extra: str) -> subprocess.Popen:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen([sys.executable, "-m", "xrlhf.cli", "run", str(path), "--output-dir", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = out / "metrics.jsonl"
        if path.is_file():
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
            if any(r.get("step", 0) >= step and "reward/mean" in r for r in rows):
                return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def assert_no_leftovers(pid: int, timeout: float = 30) -> None:
    """No process of the run's Ray session (named after the driver's pid) is left."""
    deadline = time.time() + timeout
    while True:
        left = [p for p in psutil.process_iter(["cmdline"])
                if any(f"_{pid}/" in part or part.endswith(f"_{pid}") for part in (p.info["cmdline"] or []))]
        if not left or time.time() > deadline:
            break
        time.sleep(0.5)
    assert not left, [p.info["cmdline"][:2] for p in left]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.mark.long  # a kill-and-resume scenario of over a minute: CI's make test-all runs it
def test_lora_sigkill_then_resume_ends_with_the_same_adapters(survival_config, tmp_path):
    """LoRA policy and critic on two ranks: checkpoints hold the adapters (the critic's new head too)
    and their optimizer states, not the base; a run killed and resumed ends with bit-identical
    adapters, every step once; a torn newest checkpoint is set aside for the one before. (Full
    weights on two ranks, killed during an update and resumed bit-identical: tests/e2e/test_chaos.py's
    quickstart case.)"""
    two_ranks(survival_config)  # every rank's state resumed
    pytest.importorskip("peft")
    survival_config["policy"]["train"]["lora"] = {"rank": 4, "alpha": 8, "save": "adapter"}
    survival_config["critic"]["train"]["lora"] = {"rank": 4}
    cfg = validate_dict(survival_config)
    run(cfg, tmp_path / "straight")
    proc = start(survival_config, tmp_path, tmp_path / "killed")
    wait_for_step(tmp_path / "killed", 3, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert_no_leftovers(proc.pid)
    assert run(cfg, tmp_path / "killed", resume=True)["steps"] == 5
    a, b = (load_file(str(tmp_path / d / "final" / "adapter_model.safetensors")) for d in ("straight", "killed"))
    assert a.keys() == b.keys() and all(".lora_A." in k or ".lora_B." in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ckpt = sorted((tmp_path / "killed" / "checkpoints").glob("step-*"))[-1]
    policy, critic = (torch.load(ckpt / h / "state.pt", weights_only=False) for h in ("policy", "critic"))
    assert all(".lora_" in k for k in policy["model"])  # no base weights in the checkpoint
    assert all(".lora_" in k or "score.modules_to_save" in k for k in critic["model"])
    assert not list(ckpt.glob("reference*"))  # the reference is the policy's base: nothing of it saved
    rows = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4, 5]  # nothing lost, nothing twice
    assert (tmp_path / "killed" / "report.md").is_file()
    # a torn newest checkpoint (a byte of the policy's state changed): the one before is resumed from
    ckpts = list_checkpoints(tmp_path / "killed")
    assert len(ckpts) == 2 and all(checkpoint_problem(c) is None for c in ckpts)
    state = ckpts[-1] / "policy" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    assert resume_checkpoint(tmp_path / "killed") == ckpts[0]
    assert (ckpts[-1].parent / f"torn-{ckpts[-1].name}").is_dir() and list_checkpoints(tmp_path / "killed") == ckpts[:1]


def test_resume_refuses_a_different_config(survival_config, tmp_path):
    cfg = validate_dict(survival_config)
    (tmp_path / "r" / "checkpoints" / "step-00000002").mkdir(parents=True)  # a run with a checkpoint
    (tmp_path / "r" / "checkpoints" / "step-00000002" / "manifest.json").write_text('{"step": 2, "files": {}}')
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    survival_config["algorithm"]["kl_coef"] = 0.5
    survival_config["trainer"]["steps"] = 9
    with pytest.raises(UserError) as e:
        run(validate_dict(survival_config), tmp_path / "r", resume=True)
    lines = e.value.messages
    assert any(line.startswith("--resume: algorithm.kl_coef differs") for line in lines)
    assert any(line.startswith("--resume: trainer.steps differs") for line in lines)


@pytest.mark.parametrize("sig,code", [pytest.param(signal.SIGTERM, 0, marks=pytest.mark.long), (signal.SIGINT, 130)])
# SIGINT in make test; SIGTERM's run (~1 minute beside a busy core) in make test-all (CI)
def test_signal_checkpoints_and_exits(survival_config, tmp_path, sig, code):
    proc = start(survival_config, tmp_path, tmp_path / "run", "trainer.steps=50", "algorithm.kl_coef=0.1")
    wait_for_step(tmp_path / "run", 1, proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out
    assert "Traceback" not in out
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert ckpts, out
    assert_no_leftovers(proc.pid)
    # the printed command keeps the overrides, so it resumes instead of failing the config check
    (hint,) = [line.split("resume with: ")[1] for line in out.splitlines() if "resume with: " in line]
    argv = shlex.split(hint)
    assert argv[:3] == ["xrlhf", "run", str(tmp_path / "cfg.yaml")] and argv[-1] == "--resume"
    overrides = [a for a in argv[3:] if "=" in a]
    assert overrides == ["trainer.steps=50", "algorithm.kl_coef=0.1"]
    check_output_dir(tmp_path / "run", load_config(argv[2], overrides), resume=True)


def test_sigint_during_warmup_saves_it_and_resume_is_offered(survival_config, tmp_path):
    """The warm-up saves by ``checkpoint.every`` warm-up steps, and a signal saves the step it
    ends (issue 49: a Ctrl-C once threw away 50 warm-up steps); the printed command resumes."""
    survival_config["warmup"] = {"steps": 100000, "batch_size": 16}
    survival_config["checkpoint"] = {"every": 25, "keep": 2}
    proc = start(survival_config, tmp_path, tmp_path / "run")
    while not list_checkpoints(tmp_path / "run", WARMUP):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert time.time() - t0 < 20  # not after the warm-up, the Ray start-up and a step
    assert "SIGINT: finishing the current warm-up step, then checkpoint and stop" in out
    steps = [checkpoint_step(c) for c in list_checkpoints(tmp_path / "run", WARMUP)]
    stopped = [x for x in out.splitlines() if "warm-up stopped at step " in x]
    assert steps[-1] >= 25 and stopped and f"step {steps[-1]}/100000" in stopped[0]  # the step it ended, saved
    assert f"resume with: xrlhf run {tmp_path / 'cfg.yaml'} --output-dir {tmp_path / 'run'} --resume\n" in out
    assert "Ray" not in out and "Traceback" not in out
    cfg = load_config(tmp_path / "cfg.yaml")
    assert check_output_dir(tmp_path / "run", cfg, True) == RESUME
    with pytest.raises(UserError, match="add --resume"):
        check_output_dir(tmp_path / "run", cfg, False)


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_dead_worker_stops_the_run_naming_it(survival_config, tmp_path):
    """With healing off (tests/e2e/test_healing.py: on, the default)."""
    survival_config["trainer"]["steps"] = 50
    survival_config["fault_tolerance"] = {"max_restarts": 0}
    proc = start(survival_config, tmp_path, tmp_path / "run")
    wait_for_step(tmp_path / "run", 1, proc)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "EngineWorker" in " ".join(p.cmdline())]
    assert workers
    t0 = time.time()
    workers[0].kill()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert time.time() - t0 < 60
    assert " rank " in out and " died" in out
    assert "fault_tolerance.max_restarts" in out  # how to go on: --resume, or start again if nothing was saved
    assert "--output-dir" in out and ("--resume" in out or "no checkpoint was written" in out)
    assert_no_leftovers(proc.pid)


def cli_run(tmp_path: Path, out: Path, *extra: str) -> subprocess.Popen:
    """``xrlhf run cfg.yaml --output-dir out ...`` (the config ``start`` wrote), output captured."""
    return subprocess.Popen([sys.executable, "-m", "xrlhf.cli", "run", str(tmp_path / "cfg.yaml"), "--output-dir",
                             str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_a_live_run_refuses_a_second_writer(survival_config, tmp_path):
    """Issue 49: a second ``--resume`` into a live run once resumed from a checkpoint the live run then
    rotated away, and cut the live run's metrics.jsonl short. Now a second writer, with or without
    --resume, is refused in one line naming the live run, exit 2, and the live run goes on whole."""
    survival_config["trainer"]["steps"] = 1000  # alive until killed below (50 steps ended before the second came)
    out = tmp_path / "run"
    proc = start(survival_config, tmp_path, out)
    try:
        wait_for_step(out, 1, proc)  # the lock is held from before the warm-up; metrics hold a step by now
        record = json.loads((out / "run.lock").read_text())
        assert record["pid"] == proc.pid
        second = [cli_run(tmp_path, out, "--resume"), cli_run(tmp_path, out)]  # the config's warnings, then one line
        for p in second:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 2, stderr
            errors = [x for x in stderr.splitlines() if " | WARNING | " not in x]
            assert errors == [f"error: --output-dir: {out} is being written by a live run (pid {proc.pid} on "
                              f"{record['host']}, started {record['started']}); wait for it to end or stop it "
                              f"(kill -INT {proc.pid}), or choose another --output-dir"]
            assert stdout == ""
        wait_for_step(out, 2, proc)  # the live run goes on, its metrics whole
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip().endswith("}")]
        assert [r["step"] for r in rows if "reward/mean" in r][:2] == [1, 2]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert_no_leftovers(proc.pid)
    with RunLock(out):  # the dead run's lock is free: the kernel dropped it with the process
        pass


@pytest.mark.long  # a run and its extension, over a minute: CI's make test-all runs it
def test_a_finished_run_goes_on_to_more_steps(survival_config, tmp_path):
    """``--resume trainer.steps=3`` on a finished 2-step run (a constant LR: the schedule does not
    depend on the run's length) continues it from its last checkpoint and ends with the weights
    of a 3-step run."""
    survival_config["trainer"].update(steps=2, eval_every=0)  # an evaluation between steps draws from the sampler
    run(validate_dict(survival_config), tmp_path / "extended")
    survival_config["trainer"]["steps"] = 3
    cfg = validate_dict(survival_config)
    summary = run(cfg, tmp_path / "extended", resume=True)
    assert summary["steps"] == 3
    rows = [json.loads(x) for x in (tmp_path / "extended" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [0, 3]  # the 2-step run's final eval was cut
    run(cfg, tmp_path / "straight")
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "extended")
    for k in a:
        assert torch.equal(a[k], b[k]), k
