"""Runs that heal themselves, exactly (issue 17): one run in which a worker of every role is
killed (SIGKILL) or frozen (SIGSTOP) at a random point of a step, one fault per step
(``benchmarks/recovery/healing.py``'s scenario), finishes on its own with the final weights, bit for
bit, of an uninterrupted run. The handles without training state are restarted in place; the
critic's and the policy's faults restart every worker from the last checkpoint. One run each;
the assertions share them."""

from __future__ import annotations

import json

import psutil
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.recovery.healing import FAULTS, run_with_faults, scenario_config, scenario_faults
from xrlhf.checkpoint import list_checkpoints
from xrlhf.runner import run
from xrlhf.validation import validate_dict


@pytest.mark.long  # the scenario of benchmarks/recovery/healing.py (its figures: docs/benchmarks.md), ~2.5 minutes
@pytest.mark.usefixtures("ray_session")
def test_every_role_killed_or_frozen_mid_step_heals_to_the_same_weights(tiny_model, tmp_path):
    cfg = scenario_config(tiny_model)
    run(validate_dict(cfg), tmp_path / "straight")
    faults = scenario_faults()
    code, out, wall = run_with_faults(cfg, tmp_path / "faults", faults, seed=0)
    assert code == 0, out[-5000:]
    assert "Traceback" not in out
    run_dir = tmp_path / "faults" / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    events = summary["healed"]
    assert [(e["handle"], e["rank"]) for e in events] == [(h, r) for h, r, _ in FAULTS], events
    in_place = [e["how"] == "in place" for e in events]
    assert in_place == [True, True, True, False, False], events
    assert "stopped answering" in events[1]["error"] and "stopped answering" in events[4]["error"]
    assert all(e["recover_s"] > 0 for e in events)
    # what died, when, what was restarted, how much work was redone: in the log
    log = (run_dir / "train.log").read_text()
    assert "restarting rollout (1 worker(s)) in place" in log and "re-synced (verified)" in log
    assert "restarting every worker from checkpoint step-" in log and "redoing step" in log
    # nothing lost, nothing twice
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, cfg["trainer"]["steps"] + 1))
    # the same run: the policy's final weights and the critic's last checkpoint, bit for bit
    a = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    b = load_file(str(run_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ca, cb = (torch.load(list_checkpoints(d)[-1] / "critic" / "state.pt", weights_only=False)["model"]
              for d in (tmp_path / "straight", run_dir))
    assert all(torch.equal(ca[k], cb[k]) for k in ca)
    # the frozen workers were killed, not left behind stopped
    for f in faults:
        assert not psutil.pid_exists(f.pid) or psutil.Process(f.pid).status() == psutil.STATUS_ZOMBIE, f
