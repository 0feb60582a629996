"""Every CPU config of docs/algorithms.md ("Configs that learn on CPU"), docs/lora.md, docs/async.md
and docs/deepspeed.md over several seeds, on the current code (issue 26: each learning figure the
docs state holds on at least 3 seeds).

Runs ``xrlhf run CONFIG --output-dir RUNS/<name>-SEED seed=SEED`` one run at a time (the box has
two cores) and writes, per config and seed, ``summary.json``'s greedy eval reward after the warm-up
and after the last step (for ``rm``: held-out pairwise accuracy; for ``qa_ppo``: the reward
model's score), the wall time and the load average; then per config the mean and the sample
standard deviation of each. ``qa_ppo`` reads the reward model of ``configs/rm.yaml`` trained
once with seed 0 into ``runs/rm`` (as docs/algorithms.md says to), so its seeds vary the policy
and its RL only. ``make data`` first. Usage::

    python -m benchmarks.learning_seeds --seeds 0 1 2 --out benchmarks/results/learning_seeds.json

The README's table (how much ``configs/quickstart.yaml`` learns, per seed, on this machine) is the
same measurement of one config::

    python -m benchmarks.learning_seeds --configs quickstart --seeds 0 1 2 3 4 --runs-dir runs \
        --out benchmarks/results/quickstart_seeds.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIGS = ["dpo", "kto_offline", "kto_online", "rm", "qa_ppo", "grpo_lora", "grpo_async", "quickstart_deepspeed"]


def one_seed(seed: int, runs_dir: Path, config: str, overrides: tuple[str, ...] = ()) -> dict:
    """One run of ``config`` with ``seed`` (and ``overrides``, ``key=value`` as the CLI takes them)
    into ``runs_dir/qs-SEED``: its greedy eval reward before and after the RL, and its times."""
    out = runs_dir / f"qs-{seed}"
    load0 = os.getloadavg()[0]
    t0 = time.time()
    cmd = [sys.executable, "-m", "xrlhf.cli", "run", config, "--output-dir", str(out), f"seed={seed}", *overrides]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    initial, final = summary["eval_reward_initial"], summary["eval_reward_final"]
    return {"seed": seed, "initial": initial, "final": final, "gain": final - initial,
            "wall_s": summary["wall_seconds"], "process_s": time.time() - t0,
            "load_start": load0, "load_end": os.getloadavg()[0]}


def summary(rows: list[dict]) -> dict:
    out = {"seeds": [r["seed"] for r in rows]}
    for k in ("initial", "final", "gain"):
        values = [r[k] for r in rows]
        out[f"{k}_mean"] = round(statistics.mean(values), 4)
        out[f"{k}_std"] = round(statistics.stdev(values), 4) if len(values) > 1 else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "learning-seeds")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "learning_seeds.json")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides for every run (retuning a config); the runs go to RUNS/<name>+<overrides>")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    data = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "commit": commit,
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.learning_seeds", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "configs": {}}
    if "qa_ppo" in args.configs and not (REPO / "runs" / "rm" / "final").is_dir():
        subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", "configs/rm.yaml", "--output-dir", "runs/rm"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    for name in args.configs:
        rows = []
        for seed in args.seeds:
            runs = args.runs_dir / "+".join([name, *args.set])
            row = one_seed(seed, runs, f"configs/{name}.yaml", tuple(args.set))
            rows.append({**row, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
            print(f"{name} seed {seed}: {row['initial']:.3f} -> {row['final']:.3f} ({row['gain']:+.3f}), "
                  f"{row['wall_s']:.0f} s", flush=True)
            data["configs"][name] = {"runs": rows, **summary(rows), **({"overrides": args.set} if args.set else {})}
            args.out.write_text(json.dumps(data, indent=1) + "\n")  # after every run: a cut run keeps the rest
    for name, c in data["configs"].items():
        print(f"{name}: {c['initial_mean']:.3f} -> {c['final_mean']:.3f} +- {c['final_std']:.3f} "
              f"(gain {c['gain_mean']:+.3f} +- {c['gain_std']:.3f})")


if __name__ == "__main__":
    main()
