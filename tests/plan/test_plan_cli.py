"""``xrlhf plan`` end to end (text, PNG, exit codes) and the plan's check in ``xrlhf validate``."""

from __future__ import annotations

from pathlib import Path

import pytest

from xrlhf.cli import main

ROOT = Path(__file__).parents[2]
W = str(ROOT / "configs" / "gpu" / "grpo_w.yaml")
SHAPES = ROOT / "configs" / "shapes"
pytestmark = pytest.mark.usefixtures("restore_environ")  # main() runs in this process


def test_plan_of_w_on_one_h100_fits_and_draws(tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc = main(["plan", W, f"policy.model={SHAPES / 'model-0.5b'}", "--gpu-memory", "79.2", "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0 and png.stat().st_size > 10_000
    assert "## co-located, sync, sleep level 2 (as configured): fits" in out
    assert "| train | " in out and "cuda_ipc (used)" in out
    assert "split (1 generator GPUs), sync | 2 | " in out and "needs 2 GPUs, the cluster has 1" in out


def test_a_plan_that_does_not_fit_names_phase_handle_numbers_and_a_fix(capsys):
    rc = main(["plan", W, f"policy.model={SHAPES / 'qwen2.5-7b'}", "policy.resources.ranks=8",
               "policy.generate.kv_cache_tokens=null", "--gpus", "8", "--gpu-memory", "79.2"])
    out = capsys.readouterr().out
    assert rc == 2
    # the fullest phase is the sync: vLLM awake again by its end beside the policy's 127.7 GiB (18 bytes x
    # 7.6B parameters: mixed precision, no ZeRO) and the bucket it sends from (0.25 GiB)
    assert ("does not fit: sync: the GPUs of policy+rollout+reference need " in out
            and "policy holds 128.0 GiB" in out)
    assert "\nfix: policy.train.engine=deepspeed policy.train.zero_stage=" in out


def test_link_speeds_and_bad_flags(capsys):
    args = ["plan", W, f"policy.model={SHAPES / 'model-0.5b'}", "--gpu-memory", "79.2"]
    assert main(args + ["--link", "cuda_ipc=0.92"]) == 0
    assert "cuda_ipc (used): 1.00 s over cuda_ipc at 0.92 GiB/s" in capsys.readouterr().out  # 0.917 GiB / 0.92
    assert main(args + ["--link", "warp=3"]) == 2
    assert "error: --link warp=3: unknown link 'warp'" in capsys.readouterr().err


def test_validate_refuses_a_gpu_config_whose_plan_does_not_fit(base_config, monkeypatch):
    import xrlhf.validation as v
    from xrlhf.plan import machine
    from xrlhf.utils.errors import UserError

    gpu = {**base_config, "policy": {**base_config["policy"], "resources": {"ranks": 1, "gpus_per_rank": 1}}}
    monkeypatch.setattr(machine, "gpu_total_gib", lambda: 0.01)  # a 10 MiB GPU: nothing fits
    with pytest.raises(UserError) as e:
        v.validate_dict(gpu)
    assert len(e.value.messages) == 1
    assert e.value.messages[0].startswith("plan (co-located, sync, vLLM awake): ")
    assert "the GPUs of policy+rollout+critic+reference need " in e.value.messages[0]
    assert e.value.messages[0].endswith("check_plan=false runs it anyway)")
    v.validate_dict({**gpu, "check_plan": False})  # the user's word over the model's
    monkeypatch.setattr(machine, "gpu_total_gib", lambda: 79.2)
    v.validate_dict(gpu)
    monkeypatch.setattr(machine, "gpu_total_gib", lambda: 0.01)
    v.validate_dict(base_config)  # on CPU: no GPU memory to check


def test_validate_a_one_step_off_gpu_config(base_config, monkeypatch):
    """One step off on a GPU the generator is told what the trainer's peak leaves it: the estimate
    reads the config, which is not hashable (a cache keyed by it broke every such run)."""
    import xrlhf.validation as v
    from xrlhf.plan import machine

    gpu = {**base_config, "policy": {**base_config["policy"], "resources": {"ranks": 1, "gpus_per_rank": 1}},
           "rollout": {"max_staleness": 1}, "algorithm": {**base_config["algorithm"], "off_policy": {"correction": "tis"}}}
    monkeypatch.setattr(machine, "gpu_total_gib", lambda: 141.0)
    plan = v.rollout_plan(v.validate_dict({**gpu, "check_plan": False}), split=False)
    assert plan.device_gib == 141.0 and plan.trainer_gib is not None and 0 < plan.trainer_gib < 141
