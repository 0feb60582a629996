"""Bad numbers and bad reward functions: skipped and counted, or a clear stop; logs and report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from xrlhf.validation import validate_dict
from xrlhf.runner import run
from xrlhf.utils.errors import NonFiniteError, UserError

pytestmark = pytest.mark.usefixtures("ray_session")  # runs handles in this process



def rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_function_reward_tensorboard_report_and_periodic_eval(base_config, tmp_path):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:length_reward"}
    base_config["trainer"].update(steps=4, eval_every=2)
    summary = run(validate_dict(base_config), tmp_path / "run")
    out = tmp_path / "run"
    steps = [r for r in rows(out) if "reward/mean" in r]
    assert len(steps) == 4 and all(0 <= r["reward/mean"] <= 1 for r in steps)
    assert [r["step"] for r in rows(out) if "eval/reward_mean" in r] == [0, 2, 4]
    assert "eval/reward_mean" in steps[1]  # periodic eval is logged with its step
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    for png in ("reward.png", "kl.png", "losses.png", "throughput.png", "phases.png"):
        assert (out / "plots" / png).stat().st_size > 1000, png
    report = (out / "report.md").read_text()
    assert "![reward](plots/reward.png)" in report and str(summary["eval_reward_final"]) in report
    (out / "report.md").unlink()
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "report", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and (out / "report.md").is_file()


def test_nan_rewards_skip_steps_then_abort(base_config, tmp_path):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:nan_reward"}
    base_config["trainer"]["steps"] = 10
    base_config["fault_tolerance"] = {"max_bad_steps": 2}
    with pytest.raises(NonFiniteError, match="2 consecutive steps with non-finite rewards"):
        run(validate_dict(base_config), tmp_path / "run")
    skipped = [r for r in rows(tmp_path / "run") if r.get("skipped_step")]
    assert len(skipped) == 1  # the first bad step is skipped and logged, the second aborts
    assert (tmp_path / "run" / "report.md").is_file()  # an aborted run still explains itself


def test_raising_reward_scores_zero_and_is_counted(base_config, tmp_path):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:flaky_reward"}
    base_config["fault_tolerance"] = {"reward_errors": "zero"}
    run(validate_dict(base_config), tmp_path / "run")
    steps = [r for r in rows(tmp_path / "run") if "reward/mean" in r]
    assert all("reward/errors" in r for r in steps)
    assert sum(r["reward/errors"] for r in steps) > 0


def test_raising_reward_fails_with_one_line(base_config, tmp_path):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:flaky_reward"}
    base_config["trainer"]["steps"] = 1
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base_config))
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", str(path), "--output-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert "reward.function tests.e2e.reward_fns:flaky_reward: raised ValueError" in line
    assert "fault_tolerance.reward_errors: zero" in line


def test_unknown_reward_function_is_a_config_error(base_config):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:nope"}
    with pytest.raises(UserError, match="reward.function: module 'tests.e2e.reward_fns' has no attribute 'nope'"):
        validate_dict(base_config)


def test_wandb_offline(base_config, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    base_config["trainer"]["steps"] = 1
    base_config["logging"] = {"wandb": True, "wandb_mode": "offline", "tensorboard": False}
    run(validate_dict(base_config), tmp_path / "run")
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
