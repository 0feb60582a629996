"""On-policy distillation with the student sampling through vLLM on one GPU (issue 27, item 2):
configs/gpu/distill_vllm.yaml as shipped, the CPU recipe's models and steps. The teacher is
``runs/distill-teacher/final`` where it exists (configs/distill_teacher.yaml's output), else built
here first by that config (~3 minutes). The run is kept under ``$XRLHF_GPU_RUNS`` when set.

The CPU recipe's student reaches 83-86% of the teacher over seeds 0-2 (docs/algorithms.md); the
same 80% target is checked here, an expected failure with the figures where this GPU's trajectory
lands below it, once the parts that always hold have passed."""

from __future__ import annotations

import json

import pytest

from tests.gpu.gpu_helpers import ROOT, cli_overrides
from tests.gpu.test_ppo_vllm import keep_run
from xrlhf.models.tiny import PRESETS, build_model
from xrlhf.runner import run
from xrlhf.validation import load_config

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")


def test_distilled_student_sampling_with_vllm_learns_from_the_teacher(tmp_path):
    import ray

    if ray.is_initialized():  # each run starts its own Ray from its config (the GPU)
        ray.shutdown()
    teacher = ROOT / "runs" / "distill-teacher" / "final"
    if not (teacher / "config.json").is_file():
        small = build_model(tmp_path / "small-char", **PRESETS["small"])
        run(load_config(ROOT / "configs" / "distill_teacher.yaml", [f"policy.model={small}"]), tmp_path / "teacher")
        teacher = tmp_path / "teacher" / "final"
    tiny = build_model(tmp_path / "tiny-char")
    out = tmp_path / "student"
    extra = (f"policy.model={tiny}", f"teacher.model={teacher}", *cli_overrides())
    summary = run(load_config(ROOT / "configs" / "gpu" / "distill_vllm.yaml", list(extra)), out)
    keep_run("distill_vllm", out, extra)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/reverse_kl" in r]
    assert len(steps) == 300
    for r in steps:  # every step sampled through vLLM after a sync (verified: weight_sync.verify)
        assert r["time/generate_s"] > 0 and r["time/sync_s"] > 0 and r["time/teacher_s"] > 0
    kl = [r["distill/reverse_kl"] for r in steps]
    assert sum(kl[-20:]) < 0.5 * sum(kl[:20]), kl
    final = summary["eval_final"]
    teacher_reward = final["eval/teacher_reward_mean"]
    assert teacher_reward >= 0.7, summary
    assert final["eval/reward_mean"] >= 0.45, summary
    if final["eval/reward_mean"] < 0.8 * teacher_reward:
        pytest.xfail(f"the student's greedy eval reward {final['eval/reward_mean']:.3f} is "
                     f"{final['eval/reward_mean'] / teacher_reward:.0%} of the teacher's {teacher_reward:.3f} on this "
                     f"GPU (target 80%; 83-86% over seeds 0-2 on the 2-core CPU box)")
