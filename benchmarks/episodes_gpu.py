"""Episodes on the GPU: the calculator env with vLLM on the ``0.5b`` preset, sync and one-step-off.

One GPU, co-located (``configs/gpu/grpo_w.yaml``'s engines: vLLM generates, HF trains bf16),
env ``calc`` (3-digit products, the calculator tool, episodes of up to 3 turns), GRPO on
32 prompts x 8 episodes per step. vLLM serves the episodes' turns by continuous batching: one
request per episode turn, sent the moment its episode is ready (``algorithms/rollout/episodes.py``).

A random model never emits a stop token, so every turn would end at ``max_new_tokens`` and no
episode would reach a second turn: the ``sync`` mode first warms the model up (supervised, on the
env's tool-using conversations) so that it calls the tool and answers; ``async`` starts from that
warm-up's weights (``--from RUN_DIR``). Per mode, from the steps' metrics (step 2 on): episodes
per second of generation (episodes / ``time/generate_s``) and of the whole step, sampled tokens
per second, turns, tool calls and truncation per episode, the step time. Writes
``<out>/episodes_gpu_<mode>.json``.

    python -m benchmarks.episodes_gpu --mode sync --out $OUT --runs-dir $OUT/runs
    python -m benchmarks.episodes_gpu --mode async --from $OUT/runs/sync --out $OUT --runs-dir $OUT/runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

CONFIG = "configs/gpu/grpo_w.yaml"
OVERRIDES = ["env={name: calc, options: {min_digits: 3, max_digits: 3, eval_size: 32}}",
             "trainer.prompts_per_step=32", "trainer.samples_per_prompt=8", "algorithm.mini_batch_size=256",
             "trainer.eval_size=32", "policy.generate.max_new_tokens=48", "policy.train.lr=2.0e-5"]
WARMUP = ["warmup.steps=60", "warmup.batch_size=32", "warmup.lr=1.0e-4"]


def summarize(rows: list[dict[str, Any]], episodes_per_step: int) -> dict[str, Any]:
    steps = [r for r in rows if r.get("step", 0) >= 2 and "time/step_s" in r]

    def med(key: str) -> float | None:
        xs = [r[key] for r in steps if key in r]
        return round(statistics.median(xs), 4) if xs else None

    gen_s, step_s = med("time/generate_s"), med("time/step_s")
    return {"steps_timed": len(steps), "step_s_median": step_s, "generate_s_median": gen_s,
            "episodes_per_s_generation": round(episodes_per_step / gen_s, 1) if gen_s else None,
            "episodes_per_s_step": round(episodes_per_step / step_s, 1) if step_s else None,
            "tokens_per_s": med("perf/gen_tokens_per_s"), "turns_mean": med("episode/turns_mean"),
            "tool_calls_mean": med("episode/tool_calls_mean"), "tool_errors_mean": med("episode/tool_errors_mean"),
            "truncated_frac": med("episode/truncated_frac"), "tokens_mean": med("episode/tokens_mean"),
            "reward_mean": med("reward/mean")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["sync", "async"], required=True)
    p.add_argument("--from", dest="source", default=None, help="async: the sync run's directory (its warm-up)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--runs-dir", default="runs/episodes_gpu")
    args = p.parse_args(argv)

    from benchmarks.common import ROOT, ensure_model, gpu_name, run_one, write_json
    from xrlhf.report import read_metrics

    model = ensure_model()
    overrides = [*OVERRIDES, f"trainer.steps={args.steps}"]
    if args.mode == "sync":
        overrides += [*WARMUP, f"policy.model={model}"]
    else:
        if not args.source:
            p.error("--mode async needs --from <the sync run's directory> (its warmed-up model)")
        overrides += ["warmup.steps=0", f"policy.model={Path(args.source) / 'warmup'}", "rollout.max_staleness=1",
                      "policy.generate.sleep_level=0"]
    run_dir = Path(args.runs_dir) / args.mode
    result = run_one(ROOT / CONFIG, overrides, run_dir)
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    entry = {"gpu": gpu_name(), "gpus": 1, "layout": "colocated", "mode": args.mode, "env": "calc",
             "model": "0.5b preset", "episodes_per_step": 256, "error": result["error"],
             "eval_initial": result["eval_initial"], "eval_final": result["eval_final"],
             **summarize(rows, 256), "overrides": overrides,
             "command": "python -m benchmarks.episodes_gpu " + " ".join(argv or sys.argv[1:])}
    print(entry, flush=True)
    print(write_json(Path(args.out), f"episodes_gpu_{args.mode}.json", entry))
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
