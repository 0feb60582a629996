"""On-policy distillation through Ray (issue 27): a run whose teacher is killed mid-step heals it in
place and ends with the weights of an uninterrupted run, bit for bit, as does a run killed whole
and resumed; one-step-off (``max_staleness: 1``) with a LoRA student on the calculator tool's
episodes; the bad inputs are one line and exit 2 before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from benchmarks.recovery.healing import Fault, run_with_faults
from tests.e2e.test_survival import start, wait_for_step
from xrlhf.models.tiny import build_model
from xrlhf.runner import run
from xrlhf.validation import load_config, validate_dict

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """Another model than the student (3 layers, other weights), the student's tokenizer."""
    return str(build_model(tmp_path_factory.mktemp("distill_e2e") / "teacher", layers=3, seed=1))


def distill_config(student: str, teacher: str) -> dict:
    """Distillation one step off, with the off-policy correction, checkpoints every 2 steps; 12
    steps of ~0.05 s each here, so that a teacher killed after step 2 is killed before its last
    use (with 6, a kill 0.2 s after step 2 landed after step 6 in half the runs: nothing to heal)."""
    return {"name": "distill", "seed": 0, "ray": {"num_cpus": 2},
            "env": {"name": "reasoning", "options": {"eval_size": 16}},
            "policy": {"model": student, "train": {"lr": 1e-3, "micro_batch_size": 16},
                       "generate": {"max_new_tokens": 4}},
            "reference": None, "teacher": {"model": teacher},
            "algorithm": {"name": "distill", "mini_batch_size": 16, "off_policy": {"correction": "tis"}},
            "rollout": {"max_staleness": 1},
            "trainer": {"steps": 12, "prompts_per_step": 8, "samples_per_prompt": 2, "eval_every": 3},
            "checkpoint": {"every": 2}, "fault_tolerance": {"heartbeat_timeout_s": 4.0},
            "logging": {"tensorboard": False}}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.long  # a kill-and-resume scenario of over a minute: CI's make test-all runs it
def test_teacher_killed_heals_in_place_and_a_resumed_run_is_exact(tiny_model, teacher, tmp_path):
    cfg = distill_config(tiny_model, teacher)
    straight = run(validate_dict(cfg), tmp_path / "straight")
    assert straight["eval_final"]["eval/teacher_reward_mean"] == straight["eval_initial"]["eval/teacher_reward_mean"]
    rows = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/reverse_kl" in r]
    assert [r["staleness/max"] for r in steps] == [0] + [1] * 11
    assert all(r["perf/teacher_tokens_per_s"] > 0 for r in steps)
    assert "## Student and teacher" in (tmp_path / "straight" / "report.md").read_text()

    # within_s: the kill lands within about a step of step 3 (the helper's default is a GPU step)
    code, out, _ = run_with_faults(cfg, tmp_path / "faults", [Fault("teacher", 0, "SIGKILL", step=3)], within_s=0.05)
    assert code == 0, out[-4000:]
    healed = json.loads((tmp_path / "faults" / "run" / "summary.json").read_text())["healed"]
    assert [(e["handle"], e["how"]) for e in healed] == [("teacher", "in place")]
    assert_same_weights(tmp_path / "straight", tmp_path / "faults" / "run")

    proc = start(cfg, tmp_path, tmp_path / "killed")
    wait_for_step(tmp_path / "killed", 3, proc)  # the step-2 checkpoint is written
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert run(validate_dict(cfg), tmp_path / "killed", resume=True)["steps"] == 12
    assert_same_weights(tmp_path / "straight", tmp_path / "killed")


def test_one_step_off_lora_student_on_tool_episodes(tiny_model, teacher, tmp_path):
    """The calculator env's episodes: the teacher scores the student's turns, the tool's output is
    masked; the student trains LoRA adapters; generation runs one step ahead."""
    overrides = [f"policy.model={tiny_model}", f"teacher.model={teacher}", "algorithm.name=distill",
                 "algorithm.kl_coef=0", "reference=null", "trainer.steps=2", "trainer.eval_size=8",
                 "warmup.steps=4", "warmup.batch_size=16", "policy.train.micro_batch_size=16",
                 "trainer.prompts_per_step=4", "trainer.samples_per_prompt=2", "algorithm.mini_batch_size=8",
                 "trainer.save_final=false", "rollout.max_staleness=1", "algorithm.off_policy={correction: tis}",
                 "policy.train.lora={rank: 4, alpha: 8, target_modules: all-linear}", "teacher.evaluate=false",
                 "policy.resources.ranks=1"]  # one rank: each is a process to start (~7 CPU-s here)
    cfg = load_config(REPO / "configs" / "tool_calc.yaml", overrides)
    assert run(cfg, tmp_path / "run")["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/reverse_kl" in r]
    assert len(steps) == 2 and all("episode/tool_calls_mean" in r for r in steps)
    assert [r["staleness/max"] for r in steps] == [0, 1]
    assert not any("eval/teacher_reward_mean" in r for r in rows)


def cli(tmp_path: Path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", str(path), "--output-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=300)


def test_bad_teachers_are_one_line_and_exit_2(tiny_model, teacher, tmp_path):
    bpe = str(build_model(tmp_path / "bpe", tokenizer="bpe", vocab_size=300))
    cases = [({"model": bpe}, "teacher.model: ", "another tokenizer than policy.model"),
             ({"model": str(tmp_path / "missing")}, "teacher.model: ", "no such model directory"),
             ({"model": teacher, "infer": {"engine": "vllm"}}, "teacher.infer.engine: ", "generate engines only")]
    for section, where, what in cases:
        cfg = distill_config(tiny_model, teacher)
        cfg["teacher"] = section
        done = cli(tmp_path, cfg)
        lines = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert lines[0].startswith("error: " + where) and what in lines[0], lines
        assert "Traceback" not in done.stderr and not (tmp_path / "r").exists()
