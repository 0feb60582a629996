"""Stopping a run, however it is stopped (issue 49), timed from the signal to the process's exit:

* Ctrl-C with a tool stuck in ``run()`` (``stuck_tool.py``: it heeds no time-out) saves the last
  step done and exits within seconds, one step off (the next batch held up) or synchronous (the
  step's own batch held up); a second Ctrl-C exits within 2 s, still leaving a checkpoint; the
  run resumes from it;
* a run killed with SIGKILL in its warm-up, after a warm-up checkpoint, resumes to the weights of
  an uninterrupted run;
* a driver killed with SIGKILL leaves no process (Ray's helpers included).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from xrlhf.checkpoint import WARMUP, checkpoint_step, list_checkpoints, resume_checkpoint
from xrlhf.internals.watchdog import GRACE_S, POLL_S
from xrlhf.runner import STOP_GRACE_S, run
from xrlhf.validation import validate_dict

from tests.e2e.stuck_tool import MARKER
from tests.e2e.test_survival import final_weights, start, wait_for_step

pytestmark = pytest.mark.usefixtures("ray_session")  # resumes and uninterrupted runs run in this process

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def stuck_config(base_config, tmp_path, monkeypatch) -> dict:
    """GRPO on one-turn episodes whose every turn calls ``Stuck`` (``sandbox: none``, ``timeout_s``
    50 under a turn limit of 60 s: the config check wants it below); the subprocess runs find
    ``tests.e2e.stuck_tool`` and the marker that makes the tool stuck."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(MARKER, str(tmp_path / "stuck"))
    base_config.pop("critic")
    base_config.pop("reference")
    base_config["env"] = {"name": "tests.e2e.stuck_tool:EveryTurnCallsIt", "options": {
        "tools": [{"name": "tests.e2e.stuck_tool:Stuck", "options": {"sandbox": "none", "timeout_s": 50}}],
        "step_timeout_s": 60, "max_turns": 1, "min_digits": 1, "max_digits": 1, "eval_size": 4}}
    base_config["policy"]["generate"] = {"max_new_tokens": 32, "temperature": 1.0}
    base_config["algorithm"] = {"name": "grpo", "mini_batch_size": 8, "kl_coef": 0.0}
    base_config["trainer"] = {"steps": 12, "prompts_per_step": 4, "samples_per_prompt": 2, "eval_every": 0}
    base_config["logging"] = {"tensorboard": False}
    return base_config


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")] if path.is_file() else []


def steps_done(out: Path) -> list[int]:
    return [r["step"] for r in rows(out) if "reward/mean" in r]


def make_stuck(tmp_path: Path, out: Path, proc: subprocess.Popen, quiet_s: float = 3.0) -> int:
    """Make the tool stuck, then wait until the run is: no new step for ``quiet_s``. Returns the
    last step done."""
    (tmp_path / "stuck").touch()
    done, since = steps_done(out), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert proc.poll() is None, "the run ended: no tool call got stuck"
        if steps_done(out) != done:
            done, since = steps_done(out), time.monotonic()
        time.sleep(0.1)
    return done[-1]


def reader(proc: subprocess.Popen) -> list[str]:
    """The run's output, read in a thread (a full pipe would hold it up while the test times it)."""
    out: list[str] = []
    threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True).start()
    return out


def exited_after(proc: subprocess.Popen, t0: float, timeout: float = 120) -> float:
    proc.wait(timeout)
    return time.monotonic() - t0


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_ctrl_c_with_a_stuck_tool_saves_the_step_and_exits_within_seconds(stuck_config, tmp_path):
    """One step off: while step N trains, batch N+1's episodes wait on the stuck tool. The first
    Ctrl-C finishes step N, gives up on its sync (it waits for batch N+1) and on batch N+1
    ``STOP_GRACE_S`` after the signal, checkpoints step N (without batch N+1: a resume generates it
    again) and exits; the resume finishes the run, every step logged once."""
    stuck_config["rollout"] = {"max_staleness": 1}
    stuck_config["algorithm"]["off_policy"] = {"correction": "tis", "cap": 2.0}
    out = tmp_path / "run"
    proc = start(stuck_config, tmp_path, out)
    output = reader(proc)
    wait_for_step(out, 2, proc)
    last = make_stuck(tmp_path, out, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    seconds = exited_after(proc, t0)
    text = output[0] if output else ""
    print(f"first Ctrl-C with a stuck tool: exited {seconds:.2f} s after the signal")
    # Bounded by the code: STOP_GRACE_S (3 s) until the waits give up (polled every 0.1 s), then a
    # tiny model's checkpoint, Ray's shutdown and the interpreter's exit (5.0 s measured on the
    # loaded 2-core box). The issue asks for 10 s; 15 s leaves slack for a loaded machine.
    assert seconds < 15, (seconds, text)
    assert proc.returncode == 130 and "Traceback" not in text, text
    n = steps_done(out)[-1]  # the step whose sync waited for the held-up batch: done, not synced
    assert n in (last, last + 1) and steps_done(out) == list(range(1, n + 1))
    assert "resume with: " in text and f"version {n} not synced" in text, text
    assert [checkpoint_step(c) for c in list_checkpoints(out)] == [n]  # without batch N+1
    (tmp_path / "stuck").unlink()
    summary = run(validate_dict(stuck_config), out, resume=True)
    assert summary["steps"] == 12 and steps_done(out) == list(range(1, 13))


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_a_second_ctrl_c_exits_within_two_seconds_keeping_a_checkpoint(stuck_config, tmp_path):
    """Synchronous: step N+1 waits for its own batch, held up by the stuck tool. A second Ctrl-C
    one second after the first gives up on everything at once: step N is saved (the step under
    way is dropped) and the process ends within 2 s of the second signal."""
    out = tmp_path / "run"
    proc = start(stuck_config, tmp_path, out)
    output = reader(proc)
    wait_for_step(out, 2, proc)
    last = make_stuck(tmp_path, out, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)  # within STOP_GRACE_S: the first signal alone would still wait
    assert proc.poll() is None and STOP_GRACE_S > 1.0
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    seconds = exited_after(proc, t0)
    text = output[0] if output else ""
    print(f"second Ctrl-C with a stuck tool: exited {seconds:.2f} s after it")
    assert seconds < 2.0, (seconds, text)  # 0.8 s measured: the save, Ray's shutdown, no teardown
    assert proc.returncode == 130 and "Traceback" not in text, text
    assert "resume with: " in text
    ckpt = resume_checkpoint(out)  # whole: its files match their manifest
    assert ckpt is not None and checkpoint_step(ckpt) == last and steps_done(out) == list(range(1, last + 1))


@pytest.mark.long  # a kill scenario of a minute or more: make test-all (CI) runs it
def test_a_run_killed_in_its_warmup_resumes_to_the_same_weights(base_config, tmp_path):
    """SIGKILL after a warm-up checkpoint, mid-warm-up; ``--resume`` continues the warm-up from it,
    then RL, and ends with the final weights of an uninterrupted run."""
    base_config["warmup"] = {"steps": 120, "batch_size": 16}
    base_config["checkpoint"] = {"every": 10, "keep": 2}
    base_config["trainer"] = {"steps": 2, "prompts_per_step": 16, "eval_every": 0}
    base_config["logging"] = {"tensorboard": False}
    cfg = validate_dict(base_config)
    out = tmp_path / "killed"
    proc = start(base_config, tmp_path, out)
    output = reader(proc)
    deadline = time.monotonic() + 240
    while not list_checkpoints(out, WARMUP):
        assert proc.poll() is None and time.monotonic() < deadline, output
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = [checkpoint_step(c) for c in list_checkpoints(out, WARMUP)]
    assert saved and saved[-1] < 120 and not list_checkpoints(out)  # killed in the warm-up, after a checkpoint
    assert run(cfg, out, resume=True)["steps"] == 2
    assert not list_checkpoints(out, WARMUP)  # superseded by the RL checkpoint
    run(cfg, tmp_path / "straight")
    a, b = final_weights(tmp_path / "straight"), final_weights(out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    warm = [json.loads(x)["warmup_step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "warmup_step" in x]
    assert warm == sorted(set(warm)) and warm[-1] == 120  # nothing logged twice


@pytest.mark.long  # a kill scenario of a minute or more: make test-all (CI) runs it
def test_a_killed_driver_leaves_no_process(base_config, tmp_path):
    """``kill -9`` of the driver alone (not its process group): every process it started ends
    within the watchdog's bound, Ray's DashboardAgent and RuntimeEnvAgent too (62 s without it)."""
    base_config["trainer"] = {"steps": 1000, "prompts_per_step": 16}
    base_config["logging"] = {"tensorboard": False}
    out = tmp_path / "run"
    proc = start(base_config, tmp_path, out)
    reader(proc)
    wait_for_step(out, 1, proc)
    left = psutil.Process(proc.pid).children(recursive=True)
    names = {p.name() for p in left}
    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while any(_alive(p) for p in left) and time.monotonic() - t0 < 90:
        time.sleep(0.1)
    seconds = time.monotonic() - t0
    alive = [p for p in left if _alive(p)]
    for p in alive:
        p.kill()
    print(f"a SIGKILLed driver's processes: all gone {seconds:.2f} s after the kill")
    assert not alive, [p.name() for p in alive]
    # the watchdog's bound is POLL_S + GRACE_S (1.2 s; 1.5 s measured); slack for a loaded 2-core box
    assert seconds < POLL_S + GRACE_S + 8, seconds


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
