"""Do the episode envs learn on the CPU, and does the calculator tool pay? (issue 15)

Runs (each once, seed 0 unless ``--seeds``): ``configs/tool_calc.yaml`` as shipped, the same
config without the tool (``env.options.tools=[]``: the baseline on the same large operands),
and ``configs/multiturn_qa.yaml``. Per run: eval reward (greedy) before and after, its curve,
accuracy, first-try accuracy (multiturn_qa), tool calls per episode over training (train rows
and evals), truncation rate and the wall time. Writes ``<out>/episodes_cpu.json``.

    python -m benchmarks.episodes_learning --out benchmarks/results
    python -m benchmarks.episodes_learning --runs tool_calc --steps 2 --warmup-steps 2   # smoke
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUNS = {"tool_calc": ("configs/tool_calc.yaml", []),
        "tool_calc_no_tool": ("configs/tool_calc.yaml", ["env.options.tools=[]"]),
        "multiturn_qa": ("configs/multiturn_qa.yaml", [])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides applied to every run")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--model", default=None, help="the policy's model (default: each config's)")
    return p.parse_args(argv)


def episode_curves(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step tool use and truncation of the training episodes, and the eval episode metrics."""
    train = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    evals = [r for r in rows if "eval/reward_mean" in r and "step" in r]
    keys = ("eval/reward_mean", "eval/accuracy", "eval/first_turn_correct_mean", "eval/tool_calls_mean",
            "eval/turns_mean", "eval/truncated_frac")
    return {"train": [{"step": r["step"], "reward": r["reward/mean"],
                       "tool_calls": r.get("episode/tool_calls_mean"), "turns": r.get("episode/turns_mean"),
                       "truncated": r.get("episode/truncated_frac")} for r in train],
            "eval": [{"step": r["step"], **{k.split("/", 1)[1]: r[k] for k in keys if k in r}} for r in evals]}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.async_learning import model_override, run_one
    from benchmarks.common import ROOT, write_json
    from xrlhf.report import read_metrics

    args = parse_args(argv)
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="episodes_learning-"))
    results = []
    for name in args.runs:
        config, extra = RUNS[name]
        path = ROOT / config
        for seed in args.seeds:
            overrides = model_override(path, args) + ["trainer.save_final=false", f"seed={seed}", *extra,
                                                      *args.overrides]
            overrides += [f"trainer.steps={args.steps}"] if args.steps else []
            overrides += [f"warmup.steps={args.warmup_steps}"] if args.warmup_steps is not None else []
            run_dir = runs_dir / f"{name}-s{seed}"
            print(f"== {name} seed {seed}", flush=True)
            t0 = time.time()
            r = run_one(path, overrides, run_dir)
            rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
            results.append({"run": name, "config": config, "seed": seed, **r, **episode_curves(rows)})
            print(f"   eval {r['eval_initial']} -> {r['eval_final']} in {time.time() - t0:.0f}s", flush=True)
            data = {"machine": "CPU (2 cores)", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": "python -m benchmarks.episodes_learning " + " ".join(argv or sys.argv[1:]),
                    "runs": results, "summary": summary(results)}
            write_json(Path(args.out), "episodes_cpu.json", data)  # after every run: a cut-off sweep keeps its runs
    print(Path(args.out) / "episodes_cpu.json")
    return 0 if all(r["error"] is None for r in results) else 1


def summary(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run name over its seeds: eval before and after RL (mean, sample std, each seed's) and the gain."""
    import statistics

    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["run"] for r in results):
        runs = [r for r in results if r["run"] == name and r.get("eval_final") is not None]
        if not runs:
            continue
        before, after = [r["eval_initial"] for r in runs], [r["eval_final"] for r in runs]
        gain = [b - a for a, b in zip(before, after)]
        sd = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)  # noqa: E731
        out[name] = {"seeds": [r["seed"] for r in runs], "before_mean": statistics.mean(before), "before": before,
                     "after_mean": statistics.mean(after), "after_std": sd(after), "after": after,
                     "gain_mean": statistics.mean(gain), "gain_min": min(gain)}
    return out


if __name__ == "__main__":
    sys.exit(main())
