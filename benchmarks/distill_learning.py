"""The CPU distillation recipe over seeds (issues 26, 27): the teacher built once by
``configs/distill_teacher.yaml`` (seed 0), then ``configs/distill.yaml`` as shipped for each
student seed. Per student run: the greedy eval curve (every 20 steps), the final reward and its
share of the teacher's, the reverse KL at the start and the end, and the wall time. Writes
``<out>/distill_cpu.json``; GRPO from the same start over the same seeds is
``async_learning_cpu.json`` (``configs/grpo.yaml``, sync).

    python -m benchmarks.distill_learning --seeds 0 1 2 --out benchmarks/results   # ~25 min on 2 cores
    python -m benchmarks.distill_learning --steps 2 --teacher-warmup-steps 2 --out /tmp/d  # smoke

Dotted overrides after the options apply to every student and name the JSON after ``--name``, e.g.
top-k distillation (issue 27; the recipe's character vocabulary has 128 tokens)::

    python -m benchmarks.distill_learning --name topk32 algorithm.topk_coef=1.0 teacher.infer.topk_logprobs=32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every student run")
    p.add_argument("--name", default=None, help="write distill_cpu_<name>.json (default: distill_cpu.json)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the student's seeds")
    p.add_argument("--steps", type=int, default=None, help="the student's steps (default: the config's)")
    p.add_argument("--teacher-warmup-steps", type=int, default=None, help="default: the teacher config's")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--runs-dir", default=None)
    return p.parse_args(argv)


def kl_ends(run_dir: Path) -> tuple[float | None, float | None]:
    """The mean per-token reverse KL of the first and of the last 20 steps."""
    from xrlhf.report import read_metrics

    kl = [r["distill/reverse_kl"] for r in read_metrics(run_dir) if "distill/reverse_kl" in r]
    if not kl:
        return None, None
    return round(statistics.mean(kl[:20]), 3), round(statistics.mean(kl[-20:]), 3)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.async_learning import run_one, stats
    from benchmarks.common import ROOT, ensure_model, write_json

    args = parse_args(argv)
    runs = Path(args.runs_dir or tempfile.mkdtemp(prefix="distill_learning-"))
    tiny, small = runs / "tiny-char", runs / "small-char"
    ensure_model(tiny, preset="tiny", dtype="float32")
    ensure_model(small, preset="small", dtype="float32")
    extra = [f"warmup.steps={args.teacher_warmup_steps}"] if args.teacher_warmup_steps is not None else []
    print(f"[{time.strftime('%H:%M:%S')}] the teacher", flush=True)
    teacher = run_one(ROOT / "configs" / "distill_teacher.yaml", [f"policy.model={small}", "seed=0", *extra],
                      runs / "teacher")
    if teacher["error"]:
        print(teacher["error"], file=sys.stderr)
        return 1
    students = []
    for seed in args.seeds:
        overrides = [f"policy.model={tiny}", f"teacher.model={runs / 'teacher' / 'final'}", f"seed={seed}",
                     "trainer.save_final=false"] + ([f"trainer.steps={args.steps}"] if args.steps else [])
        overrides += args.overrides
        print(f"[{time.strftime('%H:%M:%S')}] student seed {seed}", flush=True)
        r = run_one(ROOT / "configs" / "distill.yaml", overrides, runs / f"student-s{seed}")
        r["seed"], r["kl_first20"], r["kl_last20"] = seed, *kl_ends(runs / f"student-s{seed}")
        if r["eval_final"] is not None and teacher["eval_final"]:
            r["share_of_teacher"] = round(r["eval_final"] / teacher["eval_final"], 3)
        students.append(r)
        print(f"   eval {r['eval_initial']} -> {r['eval_final']} in {r['wall_s']} s", flush=True)
    finals = [r["eval_final"] for r in students if r["eval_final"] is not None]
    mean, std = stats(finals)
    data = {"machine": "CPU (2 cores)", "date": time.strftime("%Y-%m-%d"),
            "command": "python -m benchmarks.distill_learning " + " ".join(argv or sys.argv[1:]),
            "teacher": {k: teacher[k] for k in ("eval_initial", "eval_final", "eval_before_warmup", "wall_s")},
            "students": students, "student_final_mean": mean, "student_final_std": std,
            "share_of_teacher_mean": round(mean / teacher["eval_final"], 3) if mean and teacher["eval_final"] else None}
    data["student_overrides"] = args.overrides
    print(write_json(Path(args.out), f"distill_cpu{'_' + args.name if args.name else ''}.json", data))
    return 0 if all(r["error"] is None for r in students) else 1


if __name__ == "__main__":
    sys.exit(main())
