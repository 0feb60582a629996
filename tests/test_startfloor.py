"""benchmarks.startfloor: the floor of W's warm start is the median time to the actor's process
plus the median generator build from its process's birth; what W's warm start takes beyond it.
The ``ray`` probe runs here for real (a local Ray, one actor)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.startfloor import summarize


def test_the_floor_adds_the_medians_of_its_parts_and_warm_starts_are_read_against_it():
    rounds = {"ray": [{"ray_s": 3.0, "actor_s": 3.2}, {"ray_s": 3.4, "actor_s": 3.6}, {"ray_s": 9.0, "actor_s": 9.1}],
              "generator": [{"torch_s": 2.0, "total_s": 12.0}, {"torch_s": 1.0, "total_s": 11.0}]}
    out = summarize(rounds, [16.0, None, 15.0])
    assert out["median"]["ray"] == {"ray_s": 3.4, "actor_s": 3.6}
    assert out["median"]["generator"] == {"torch_s": 1.5, "total_s": 11.5}
    assert out["floor_s"] == 15.1  # 3.6 + 11.5
    assert out["warm_ready_s"] == [16.0, 15.0] and out["above_floor_s"] == 0.4  # 15.5 - 15.1


def test_a_part_missing_in_a_round_leaves_the_figure_out_and_no_probe_no_floor():
    out = summarize({"ray": [{"ray_s": 3.0, "actor_s": 3.2}], "generator": [{"total_s": 11.0, "python_s": None}]}, [])
    assert out["floor_s"] == 14.2 and "python_s" not in out["median"]["generator"] and "warm_ready_s" not in out
    assert "floor_s" not in summarize({"ray": [{"actor_s": 3.0}]}, [14.0])


@pytest.mark.slow
def test_the_ray_probe_starts_ray_and_times_the_actor_in_its_own_process(tmp_path):
    result = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "benchmarks.startfloor", "--probe", "ray", "--result", str(result)],
                   check=True, timeout=240)
    import json

    out = json.loads(result.read_text())
    # the actor's module came after Ray was up (its own process's clock, not the driver's import)
    assert 0 < out["ray_s"] <= out["actor_s"] <= out["up_s"]


@pytest.mark.slow
def test_the_generator_probe_builds_a_runs_generate_engine_in_its_own_process(tmp_path, tiny_model):
    """The quickstart's generator (the HF engine on CPU) through the probe's own path: the spec
    pickled as the driver makes it, then the worker's class, its constructor, its ``setup``."""
    import json

    from benchmarks.startfloor import write_spec

    spec, result = tmp_path / "spec.pkl", tmp_path / "g.json"
    write_spec(spec, "configs/grpo.yaml", [f"policy.model={tiny_model}"])
    subprocess.run([sys.executable, "-m", "benchmarks.startfloor", "--probe", "generator", "--spec", str(spec),
                    "--result", str(result)], check=True, timeout=300)
    out = json.loads(result.read_text())
    parts = ("python_s", "class_s", "init_s", "setup_s")
    assert all(out[k] >= 0 for k in parts) and out["setup/generate_s"] > 0
    assert out["total_s"] >= sum(out[k] for k in parts) - 0.05  # from the process's birth (clock ticks: 0.01 s)
