"""A whole PPO run through Ray on CPU: outputs a user relies on."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoModelForCausalLM

from xrlhf.runner import run
from xrlhf.utils.errors import UserError
from xrlhf.validation import validate_dict

from tests.conftest import two_ranks

pytestmark = pytest.mark.usefixtures("ray_session")  # runs handles in this process


def test_ppo_run_writes_outputs(base_config, tmp_path):
    two_ranks(base_config)  # the full run: data-parallel policy ranks and their generators
    base_config["warmup"] = {"steps": 3, "batch_size": 16}
    base_config["algorithm"]["log_entropy"] = True  # policy/entropy is reported only when asked for
    base_config["logging"] = {"memory_timeline": True}  # on CPU: each process's resident set by phase
    cfg = validate_dict(base_config)
    t_start = time.time()
    summary = run(cfg, tmp_path / "run")
    t_end = time.time()
    out = tmp_path / "run"
    assert (out / "config.yaml").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("reward/mean", "kl/mean", "policy/loss", "critic/loss", "policy/clip_frac", "policy/entropy",
                "perf/gen_tokens_per_s", "time/generate_s", "time/train_s", "time/sync_s"):
        assert key in steps[0], key
    assert abs(steps[0]["mismatch/logprob_abs_diff_mean"]) < 1e-4  # HF sampler == HF trainer
    for phase in ("generate", "sleep", "infer", "train", "sync"):  # the memory timeline, per process
        for handle in ("policy", "critic", "reference"):
            assert 0.1 < steps[1][f"memory/{phase}/{handle}_gib"] < 20, (phase, handle)
    report = (out / "report.md").read_text()
    assert "| phase | critic | policy | reference |" in report and (out / "plots" / "memory.png").is_file()
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("steps", "wall_seconds", "eval_reward_initial", "eval_reward_final", "final_checkpoint"):
        assert key in on_disk
    # the steps' spans, put on the epoch clock by timeline_origin, lie inside the run (outside probes use it)
    spans = [s for r in steps for s in r["timeline"]]
    origin = on_disk["timeline_origin"]
    assert spans and t_start - 0.01 <= origin + min(s[2] for s in spans) <= origin + max(s[3] for s in spans) <= t_end
    AutoModelForCausalLM.from_pretrained(on_disk["final_checkpoint"])
    # checkpoint.every: 0 and a 10-minute checkpoint.every_minutes: a short run checkpoints its last step only
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
    # a finished run is never overwritten, and there is nothing to resume
    with pytest.raises(UserError, match=r"--output-dir: .* already holds a finished run; choose another directory"):
        run(cfg, out)
    with pytest.raises(UserError, match=r"--resume: .* is a finished run \(2 steps, summary.json\); nothing"):
        run(cfg, out, resume=True)
    assert json.loads((out / "summary.json").read_text()) == on_disk
