"""The asynchronous-RL benchmarks on CPU: variants and their configs (validated as the GPU run
would, vLLM stood in for), the figures drawn from metrics rows, the JSON merge, the report's
sections. Nothing here starts Ray or trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import async_grpo, common, learning_cpu, report


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    """The ``small`` preset: 512 positions, room for W's 256 new tokens (the tiny one has 256)."""
    from xrlhf.models.tiny import PRESETS, build_model

    path = tmp_path_factory.mktemp("small")
    build_model(path, **PRESETS["small"])
    return str(path)


def test_variant_names():
    assert async_grpo.parse_variant("sync-colocated") == ("colocated", 0)
    assert async_grpo.parse_variant("async-split") == ("split", 1)
    assert async_grpo.parse_variant("async2-colocated") == ("colocated", 2)
    for bad in ("async-both", "sync", "async0-split"):
        with pytest.raises(SystemExit):
            async_grpo.parse_variant(bad)
    with pytest.raises(SystemExit):
        async_grpo.parse_args(["--steps", "2", "--timed-from", "3"])


def test_dry_run_validates_every_variant(small_model, tmp_path, capsys):
    args = async_grpo.parse_args(["--dry-run", "--model", small_model, "--out", str(tmp_path), "--steps", "5"])
    with async_grpo.as_if_installed("vllm", "generate"):
        configs = {name: cfg for name, cfg, _ in async_grpo.build_configs(args, small_model)}
    assert list(configs) == ["sync-colocated", "async-colocated", "sync-split", "async-split"]
    for name, cfg in configs.items():
        layout, k = async_grpo.parse_variant(name)
        g = cfg.policy.generate
        assert cfg.rollout.max_staleness == k and cfg.trainer.steps == 5 and not cfg.trainer.save_final
        assert cfg.trainer.eval_every == 0 and not cfg.policy.weight_sync.verify
        assert (g.resources is not None) == (layout == "split") and cfg.ray.num_gpus == (2 if layout == "split" else 1)
        opts = g.engine_fields()
        assert opts["sleep_level"] == (2 if (layout, k) == ("colocated", 0) else 0)
        assert cfg.algorithm.options()["mini_batch_size"] == 512 and cfg.policy.generate.max_new_tokens == 256
    assert async_grpo.main(["--dry-run", "--model", small_model, "--variants", "async-split"]) == []
    assert "rollout.max_staleness=1" in capsys.readouterr().out


def rows_of(k: int, steps: int = 5) -> list[dict]:
    """Metrics rows as a run writes them: eval at step 0, RL steps, the final eval."""
    rows = [{"step": 0, "eval/reward_mean": 0.1}]
    for s in range(1, steps + 1):
        r = {"step": s, "reward/mean": 0.2, "time/step_s": 4.0 + s % 2, "time/generate_s": 3.0, "time/train_s": 1.5,
             "gpu0/busy": 80.0 + s, "gpu0/peak_gib": 40.0 + s, "perf/tokens_per_s_per_gpu": 1000.0 * s,
             "perf/train_mfu": 0.1 * s,
             "timeline": [["trainer", "update", 10.0 * s, 10.0 * s + 2],
                          ["generator", f"b{s + 1}", 10.0 * s, 10.0 * s + 3]]}
        if k:
            r.update({"staleness/min": 1.0, "staleness/mean": 1.0, "staleness/max": 1.0})
        rows.append(r)
    return rows + [{"step": steps, "eval/reward_mean": 0.3}]


def test_figures_of_a_run_and_the_merge(tmp_path):
    sync = async_grpo.summarize(rows_of(0), timed_from=3, n_gpus=1)
    assert sync["timed_steps"] == [3, 4, 5] and sync["step_s_median"] == 5.0
    assert sync["gpu_busy"] == pytest.approx((83 * 5 + 84 * 4 + 85 * 5) / 14, abs=0.1)
    assert sync["tokens_per_s_per_gpu"] == 4000.0 and sync["train_mfu"] == 0.4  # medians of steps 3-5
    # one step off: the last step, with nothing generated beside it, is no steady-state step
    s = async_grpo.summarize(rows_of(1), timed_from=3, n_gpus=1)
    assert s["timed_steps"] == [3, 4] and s["step_s_median"] == 4.5 and s["steps"] == 5
    assert s["phases_median"] == {"generate": 3.0, "train": 1.5}
    assert s["gpu_busy"] == pytest.approx((83 * 5 + 84 * 4) / 9, abs=0.1)
    assert s["peak_gib"] == 45.0 and s["staleness_observed"] == {"min": 1.0, "mean": 1.0, "max": 1.0}
    entry = {"variant": "async-colocated", "gpu": "H", "gpus": 1, "layout": "colocated", "staleness": 1, **s}
    async_grpo.judge(entry)
    assert entry["target"] == {"step_s": 4.3, "gpu_busy": 85.0} and entry["met"] is False
    sync = {"variant": "sync-colocated", "gpu": "H", "gpus": 1, "layout": "colocated", "staleness": 0,
            "step_s_median": 7.5}
    async_grpo.write_results(tmp_path, [sync])
    async_grpo.write_results(tmp_path, [entry])
    again = {**entry, "step_s_median": 3.0}
    out = json.loads(async_grpo.write_results(tmp_path, [again]).read_text())
    assert [e["variant"] for e in out] == ["sync-colocated", "async-colocated"]  # replaced, not added
    assert out[1]["sync_step_s_median"] == 7.5 and out[1]["speedup"] == 2.5
    assert async_grpo.draw_timeline(rows_of(1), tmp_path, "colocated", 1) == "async_grpo_timeline_colocated.png"
    assert async_grpo.draw_timeline(rows_of(0), tmp_path, "split", 0) == "async_grpo_timeline_split_sync.png"
    assert (tmp_path / "async_grpo_timeline_colocated.png").stat().st_size > 0


def test_learning_figures():
    c = common.curve(rows_of(1), samples_per_step=512)
    assert [(p["step"], p["samples"], p["rl_s"]) for p in c] == [(0, 0, 0.0), (5, 2560, 23.0)]
    assert common.time_to_reach(c, 0.3) == 23.0 and common.time_to_reach(c, 0.9) is None
    runs = [{"config": "c", "steps": 2, "mode": m, "seed": s, "eval_final": f, "eval_initial": 0.0, "wall_s": 1.0,
             "error": None} for m, s, f in [("sync", 0, 0.5), ("sync", 1, 0.7), ("async", 0, 0.55), ("async", 1, 0.5)]]
    (agg,) = learning_cpu.aggregate(runs)
    assert agg["sync"]["final_mean"] == 0.6 and agg["sync"]["final_std"] == pytest.approx(0.1414, abs=1e-4)
    assert agg["async_ok"] is True  # 0.525 >= 0.6 - 0.141
    v = learning_cpu.gpu_verdict({"sync": {"error": None, "curve": [{"rl_s": 0, "eval_reward": 0.1},
                                                                      {"rl_s": 100, "eval_reward": 0.6}]},
                                    "async": {"error": None, "curve": [{"rl_s": 0, "eval_reward": 0.1},
                                                                       {"rl_s": 50, "eval_reward": 0.6}]}})
    assert v["ratio"] == 0.5 and v["met"] is True


def test_learning_plot(tmp_path):
    run = {"curve": common.curve(rows_of(1), 512), "train_reward": [[1, 5.0, 0.2], [2, 9.0, 0.3]]}
    png = learning_cpu.plot_gpu({"sync": run, "async": run}, tmp_path / "p.png")
    assert png.stat().st_size > 0


def test_async_overrides_add_a_correction_only_where_none_is_set(tiny_model):
    root = Path(async_grpo.__file__).resolve().parents[1]
    base = [f"policy.model={tiny_model}"]
    assert learning_cpu.async_overrides(root / "configs/grpo.yaml", base) == ["rollout.max_staleness=1",
                                                                               "algorithm.tis_cap=2.0"]
    assert learning_cpu.async_overrides(root / "configs/grpo_async.yaml", base) == ["rollout.max_staleness=1"]


def test_learning_gpu_dry_run(small_model):
    args = learning_cpu.parse_args(["async", "--gpu", "--dry-run", "--model", small_model, "--steps", "3"])
    out = learning_cpu.gpu_main(args)
    cfgs = out["configs"]
    assert cfgs["warmup"].warmup.steps == 150 and cfgs["warmup"].policy.generate.engine == "hf"
    assert cfgs["sync"].rollout.max_staleness == 0 and cfgs["async"].rollout.max_staleness == 1
    assert cfgs["async"].trainer.steps == 3 and cfgs["sync"].policy.train.lr == args.lr
    assert cfgs["async"].policy.generate.engine_fields()["sleep_level"] == 0


def test_report_sections(tmp_path):
    entry = {"variant": "async-split", "gpu": "H200", "gpus": 2, "layout": "split", "staleness": 1,
             "step_s_median": 3.2, "sync_step_s_median": 6.4, "speedup": 2.0, "gpu_busy": 80.0,
             "gpu_busy_per_gpu": [70.0, 90.0], "peak_gib": 50.0, "target": {"step_s": 3.5}, "met": True,
             "phases_median": {"generate": 3.0}, "staleness_observed": {"min": 1, "mean": 1.0, "max": 1},
             "timeline_png": "async_grpo_timeline_split.png", "command": "python -m benchmarks.async_grpo",
             "date": "2026-11-23 00:00:00", "baseline_h200": async_grpo.BASELINE}
    text = "\n".join(report.async_grpo([entry], lambda p: f"../r/{p}"))
    assert "| H200 | split | 2 | 1 | 3.20 | 6.40 | 2.00× | 80 (70 / 90) | 50.0 | ≤ 3.5 s | yes |" in text
    assert "![split, staleness 1](../r/async_grpo_timeline_split.png)" in text
    assert "Not run yet" in "\n".join(report.async_learning_cpu(None))
    assert "Not run yet" in "\n".join(report.async_learning_gpu(None, str))
