"""The README's table: how much ``configs/quickstart.yaml`` learns, per seed, on this machine.

Runs ``xrlhf run configs/quickstart.yaml --output-dir RUNS/qs-SEED seed=SEED`` one seed at a time
and writes, per seed, the greedy eval reward before RL (after the warm-up) and after the last
step, the wall time (``summary.json``) and the load average at the start and the end (the box is
shared: the load says how much of the wall is the run's). Usage::

    python -m benchmarks.quickstart_seeds --seeds 0 1 2 3 4 --runs-dir runs/qs \\
        --out benchmarks/results/quickstart_seeds.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def table(rows: list[dict]) -> str:
    lines = ["| seed | initial | final | gain | wall s | load avg (start / end) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['initial']:.3f} | {r['final']:.3f} | {r['gain']:+.3f} | {r['wall_s']:.0f} | "
              f"{r['load_start']:.1f} / {r['load_end']:.1f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "qs-seeds")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quickstart_seeds.json")
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        rows.append(one_seed(seed, args.runs_dir, args.config))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": args.config, "machine": platform.processor() or platform.machine(),
                                        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "runs": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
