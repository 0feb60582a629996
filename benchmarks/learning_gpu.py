"""Does GRPO learn on one GPU, and how soon beside TRL? (issue 51, items 2 and 3)

The recipe is configs/gpu/grpo_learn.yaml: a supervised warm-up of the 0.5b preset on arithmetic
word problems, then GRPO with every GPU default on. Its warm-up runs once per runs directory (seed
0's, in a process of its own, the eval before it on the Transformers engine: no vLLM start-up for
a model that answers nothing) and every RL run starts from the model it wrote (``warmup/``), so the
seeds vary the RL (sampling, data order) and a second call on the same machine reuses it.

**Learning** (default): the recipe's RL for each ``--variants`` x ``--seeds``: ``sync`` (as
shipped), ``async`` (one step off, vLLM awake beside the trainer), ``split`` and
``async-split`` (vLLM on a second GPU, ``benchmarks.async_grpo.SPLIT``). Per run: the greedy eval
reward against step and the RL clock (the sum of the steps' ``time/step_s``: start-up excluded,
the evaluations included), and whether the eval reward rose from before RL to the last eval by
``--margin`` (0.05: 13 of the 256 held-out problems). ``<out>/learning_gpu.json`` (runs kept in
``<runs-dir>/learning_gpu.json`` too, merged by variant and seed across calls) and
``<out>/learning_gpu.png`` (eval reward against the RL clock).

**Beside TRL** (``--trl``): TRL 1.16's GRPOTrainer (``benchmarks/trl_grpo.py learn``, a process of
its own, TRL's defaults where the workload leaves a choice) from the same warmed model, data and
reward, then xrlhf's sync run of the first seed in the same call (``--reuse-runs``: a kept one,
flagged). Target: xrlhf's RL clock at its
first eval at or above TRL's final eval reward <= 0.5 x TRL's clock at its own first eval there
(TRL's clock leaves its evaluations out). ``<out>/learning_vs_trl.json`` and ``.png``.

**CPU** (``--cpu-smoke``): the same path on the tiny char model, a small generated dataset and a
few steps (tests/test_learning_gpu.py); ``--dry-run``: the variants' configs validated, nothing run.

    python -m benchmarks.learning_gpu --out $OUT/learn                               # sync, seeds 0 1 2
    python -m benchmarks.learning_gpu --variants async,split --seeds 0 --out $OUT/learn_async
    python -m benchmarks.learning_gpu --trl --out $OUT/trl_learn                     # TRL 1.16 installed
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.async_grpo import SPLIT
from benchmarks.common import (ROOT, at_or_above, compile_excess, gpu_label, run_one, save_figure, steady,
                               time_to_reach, trl_env, write_json)

CONFIG = "configs/gpu/grpo_learn.yaml"
DATA = "artifacts/data/arithmetic.jsonl"
DATA_ROWS, DATA_SEED = 4000, 6
"""The recipe's data file and how ``xrlhf make-dataset arithmetic`` (``xrlhf prepare-data``) writes it."""
MARGIN = 0.05
TRL_TARGET = 0.5
VARIANTS: dict[str, list[str]] = {
    "sync": [],
    "async": ["rollout.max_staleness=1", "policy.generate.sleep_level=0"],
    "split": list(SPLIT),
    "async-split": [*SPLIT, "rollout.max_staleness=1"],
}
"""What each variant changes in the recipe."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--variants", default="sync", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--trl", action="store_true", help="TRL's GRPOTrainer beside xrlhf's sync run (first seed)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "learning_gpu"))
    p.add_argument("--config", default=str(ROOT / CONFIG))
    p.add_argument("--model", default=None, help="the policy before the warm-up (default: the recipe's)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of every run and the warm-up")
    p.add_argument("--rl-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of the RL runs (and TRL's) only: a recipe candidate that reuses the warm-up; "
                   "`best`: those of the kept seed-0 sync run that rose most (a learn_sweep's winner)")
    p.add_argument("--xrlhf-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="with --trl: overrides of xrlhf's run only (trainer.steps=90: room to reach TRL's last eval)")
    p.add_argument("--margin", type=float, default=MARGIN)
    p.add_argument("--reuse-runs", action="store_true", help="a run kept in the runs directory for the same variant, "
                   "seed and overrides is not run again (a cut call goes on where it stopped)")
    p.add_argument("--budget-s", type=float, default=0, help="start no run that the time left cannot hold, "
                   "judged by the last run's time (0: no limit)")
    p.add_argument("--trl-script", default=str(ROOT / "benchmarks" / "trl_grpo.py"), help="the TRL side (its `learn`)")
    p.add_argument("--trl-timeout", type=float, default=400)
    p.add_argument("--trl-args", default="", help="more arguments of the TRL script, one string")
    p.add_argument("--trl-site", default=None, help="TRL's own stack on its PYTHONPATH instead of xrlhf's "
                   "(benchmarks.common.trl_env)")
    p.add_argument("--cpu-smoke", action="store_true", help="the tiny CPU model, a few steps (no GPU)")
    p.add_argument("--dry-run", action="store_true", help="validate the variants' configs (vLLM may be absent)")
    args = p.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown or not args.variant_list:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none)'}; valid: {', '.join(VARIANTS)}")
    return args


# -- the recipe ---------------------------------------------------------------------------------
def smoke_overrides(runs_dir: Path) -> list[str]:
    """The recipe on CPU: the tiny char model and 400 generated rows (both built in ``runs_dir``),
    Transformers generation, float32, one rank, a few steps of a few prompts."""
    from benchmarks.common import ensure_model
    from xrlhf.data.datasets import write_jsonl
    from xrlhf.envs.word_problems import make_rows

    model = ensure_model(runs_dir / "tiny-char", preset="tiny", dtype="float32")
    data = runs_dir / "arithmetic-smoke.jsonl"
    if not data.is_file():
        write_jsonl(make_rows(400, DATA_SEED), data)
    return [f"policy.model={model}", f"env.options.dataset={data}", "env.options.eval_size=8", "ray.num_gpus=0",
            "ray.num_cpus=2", 'policy.generate={"engine": "hf", "max_new_tokens": 16}', "policy.train.dtype=float32",
            'policy.resources={"ranks": 1, "cpus_per_rank": 1}', "reference.infer.dtype=float32", "warmup.steps=4",
            "warmup.batch_size=8", "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4",
            "algorithm.mini_batch_size=16", "trainer.eval_every=1", "logging.report=false"]


def ensure_data(args: argparse.Namespace) -> None:
    """The recipe's data file, written as ``xrlhf prepare-data`` writes it when missing (a
    ``--set env.options.dataset=...`` names another file, which must exist)."""
    if any(o.startswith("env.options.dataset=") for o in args.set):
        return
    path = ROOT / DATA
    if not path.is_file():
        from xrlhf.data.datasets import write_jsonl
        from xrlhf.envs.word_problems import make_rows

        write_jsonl(make_rows(DATA_ROWS, DATA_SEED), path)
        print(f"wrote {path} ({DATA_ROWS} rows, seed {DATA_SEED})", flush=True)


def base_overrides(args: argparse.Namespace, runs_dir: Path) -> list[str]:
    """Overrides of every run and the warm-up: the CPU smoke's, ``--model``, ``--set``; relative
    paths of the recipe resolved from the repository (runs start elsewhere)."""
    out = smoke_overrides(runs_dir) if args.cpu_smoke else [f"env.options.dataset={ROOT / DATA}"]
    if args.model:
        out.append(f"policy.model={Path(args.model).resolve()}")
    elif not args.cpu_smoke:
        out.append(f"policy.model={ROOT / 'artifacts' / 'model-0.5b'}")
    return out + list(args.set)


def warmup_overrides(config: str, base: list[str]) -> list[str]:
    """The warm-up's process: seed 0, and the eval before it on the Transformers engine."""
    from xrlhf.config.loader import apply_overrides, read_yaml

    data = apply_overrides(read_yaml(config), list(base))
    g = data["policy"]["generate"]
    hf = {"engine": "hf", "dtype": g.get("dtype", "float32"), "max_new_tokens": g.get("max_new_tokens", 16)}
    return [*base, "seed=0", f"policy.generate={json.dumps(hf)}"]


def warm_up(config: str, overrides: list[str], out_dir: str) -> None:
    """The recipe's supervised warm-up (``xrlhf.algorithms.warmup``) into ``out_dir/warmup``; its
    figures in ``out_dir/warmup.json``. Runs in a process of its own: its CUDA memory is gone after."""
    from xrlhf.algorithms.warmup import supervised_warmup
    from xrlhf.data.text import load_tokenizer
    from xrlhf.envs import build_env
    from xrlhf.validation import load_config

    cfg = load_config(config, overrides)
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    rows: list[dict] = []
    t0 = time.time()
    path, before = supervised_warmup(cfg, env, load_tokenizer(cfg.policy.model), cfg.policy.model, Path(out_dir),
                                     log=rows.append)
    info = {"model": path, "steps": cfg.warmup.steps, "batch_size": cfg.warmup.batch_size, "lr": cfg.warmup.lr,
            "eval_before_warmup": before.get("eval/reward_mean"), "seconds": round(time.time() - t0, 1),
            "log": rows, "overrides": overrides}
    Path(out_dir, "warmup.json").write_text(json.dumps(info, indent=1))


def ensure_warmup(args: argparse.Namespace, runs_dir: Path, base: list[str]) -> dict[str, Any]:
    """The warmed model of ``runs_dir`` (made now when missing or made with other overrides; the runs
    kept from an earlier warm-up are then set aside)."""
    overrides = warmup_overrides(args.config, base)
    done = runs_dir / "warmup.json"
    if done.is_file() and json.loads(done.read_text()).get("overrides") == overrides:
        print(f"warm-up: reusing {done}", flush=True)
        return json.loads(done.read_text())
    done.unlink(missing_ok=True)
    for name in ("learning_gpu.json", "runs.jsonl"):  # runs from another warm-up: not to be kept beside new ones
        if (runs_dir / name).is_file():
            (runs_dir / name).rename(runs_dir / f"{name}-before-{time.strftime('%H%M%S')}")
    print(f"[{time.strftime('%H:%M:%S')}] warm-up -> {runs_dir / 'warmup'}", flush=True)
    proc = multiprocessing.get_context("spawn").Process(target=warm_up, args=(args.config, overrides, str(runs_dir)))
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not done.is_file():
        raise SystemExit(f"learning_gpu: the warm-up failed (exit code {proc.exitcode}); see the log above")
    info = json.loads(done.read_text())
    nll = info["log"][-1]["warmup/nll"] if info["log"] else None
    print(f"[{time.strftime('%H:%M:%S')}] warm-up done in {info['seconds']} s: eval before it "
          f"{info['eval_before_warmup']}, last nll {nll}", flush=True)
    return info


# -- runs ---------------------------------------------------------------------------------------
def rl_overrides(base: list[str], warm: dict[str, Any], variant: str, seed: int, rl: list[str] = ()) -> list[str]:
    """An RL run of the recipe from the warmed model (``rl``: ``--rl-set``)."""
    return [*base, f"policy.model={warm['model']}", "warmup.steps=0", f"seed={seed}", *VARIANTS[variant], *rl]


def judge(run: dict[str, Any], margin: float) -> dict[str, Any]:
    """The run with ``eval_before_rl`` (its step-0 eval), ``eval_last``, ``rise`` and ``met``."""
    pts = run.get("curve") or []
    before, last = (pts[0]["eval_reward"], pts[-1]["eval_reward"]) if pts else (None, None)
    rise = round(last - before, 4) if pts else None
    return {**run, "eval_before_rl": before, "eval_last": last, "rise": rise, "margin": margin,
            "met": None if rise is None or run.get("error") else rise >= margin}


def one_run(args: argparse.Namespace, runs_dir: Path, overrides: list[str], variant: str, seed: int) -> dict[str, Any]:
    """One RL run in this process (``common.run_one``): its curve and verdict; the run's
    checkpoints deleted after (the last one of the 0.5b model is ~6 GB), its metrics, summary,
    config and log copied to ``<out>/runs/``."""
    run_dir = runs_dir / f"{variant}-s{seed}-{time.strftime('%H%M%S')}"
    print(f"[{time.strftime('%H:%M:%S')}] {variant} seed {seed} -> {run_dir}", flush=True)
    r = run_one(Path(args.config), overrides, run_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    keep = Path(args.out) / "runs" / run_dir.name  # what comes back from the GPU machine with the JSON
    keep.mkdir(parents=True, exist_ok=True)
    for f in ("metrics.jsonl", "summary.json", "config.yaml", "train.log"):
        if (run_dir / f).is_file():
            shutil.copy(run_dir / f, keep / f)
    r = judge({"variant": variant, "seed": seed, **r, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, args.margin)
    print(f"[{time.strftime('%H:%M:%S')}] {variant} seed {seed}: eval {r['eval_before_rl']} -> {r['eval_last']} "
          f"(rise {r['rise']}, margin {args.margin}: {'met' if r['met'] else 'NOT met'}) in {r['rl_s']} s of RL, "
          f"{r['wall_s']} s in all" + (f"; ERROR {r['error']}" if r["error"] else ""), flush=True)
    return r


class Budget:
    """``--budget-s``: whether the next run fits in the time left, judged by the last one."""

    def __init__(self, seconds: float, first_guess: float):
        self.t0, self.seconds, self.last = time.time(), seconds, first_guess

    def left(self) -> float:
        return float("inf") if not self.seconds else self.seconds - (time.time() - self.t0)

    def fits(self) -> bool:
        return self.left() >= self.last

    def spent(self, wall_s: float) -> None:
        self.last = wall_s


def load_store(runs_dir: Path) -> list[dict[str, Any]]:
    """The table's runs: one per variant and seed."""
    path = runs_dir / "learning_gpu.json"
    return json.loads(path.read_text()).get("runs", []) if path.is_file() else []


def load_every(runs_dir: Path) -> list[dict[str, Any]]:
    """Every finished run from this warm-up (``runs.jsonl``): a ``learn_sweep`` candidate stays
    reusable after the next candidate took its place in the table."""
    path = runs_dir / "runs.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def keep_run(runs_dir: Path, run: dict[str, Any]) -> None:
    with open(runs_dir / "runs.jsonl", "a") as f:
        f.write(json.dumps(run) + "\n")


def best_rl_set(runs: list[dict[str, Any]]) -> list[str]:
    """``--rl-set best``: the RL overrides of the finished seed-0 sync run whose eval rose most
    (ties: the later run); ``[]`` (the recipe as written) when none was kept."""
    done = [r for r in runs if (r["variant"], r["seed"]) == ("sync", 0) and not r.get("error")
            and r.get("rise") is not None]
    if not done:
        return []
    win = max(reversed(done), key=lambda r: r["rise"])
    return list(win.get("rl_set") or [])


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` runs not replaced by a ``new`` run of the same variant and seed, then ``new``."""
    key = lambda r: (r["variant"], r["seed"])  # noqa: E731
    replaced = {key(r) for r in new}
    return [r for r in old if key(r) not in replaced] + new


def stored(runs: list[dict[str, Any]], variant: str, seed: int, overrides: list[str]) -> dict[str, Any] | None:
    """A kept run of ``variant`` and ``seed`` made with ``overrides``, that finished."""
    return next((r for r in runs if (r["variant"], r["seed"]) == (variant, seed) and r.get("overrides") == overrides
                 and not r.get("error")), None)


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.mean(r[key] for r in runs), 4)


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: seeds, mean eval before RL and last, mean and least rise, all met, RL seconds;
    for the other variants also, against sync's run of the same seed on the steady clock, the RL
    time to reach sync's last eval over sync's and the share of evals at or above sync's curve."""
    sync = {r["seed"]: r for r in runs if r["variant"] == "sync" and not r.get("error") and r.get("curve")}
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant and not r.get("error") and r.get("curve")]
        if not mine:
            out[variant] = {"seeds": [], "all_met": None}
            continue
        entry = {"seeds": [r["seed"] for r in mine], "eval_before_rl_mean": _mean(mine, "eval_before_rl"),
                 "eval_last_mean": _mean(mine, "eval_last"), "rise_mean": _mean(mine, "rise"),
                 "rise_min": min(r["rise"] for r in mine), "all_met": all(r["met"] for r in mine),
                 "rl_s_mean": _mean(mine, "rl_s"), "compile_s": [compile_excess(r["curve"]) for r in mine],
                 "s_per_step": round(statistics.mean(r["rl_s"] / r["steps"] for r in mine), 2)}
        if variant != "sync":
            ratios, above = [], []
            for r in mine:
                s = sync.get(r["seed"])
                if s:
                    target = s["curve"][-1]["eval_reward"]
                    t_s, t_v = time_to_reach(steady(s["curve"]), target), time_to_reach(steady(r["curve"]), target)
                    ratios.append(round(t_v / t_s, 3) if t_v is not None and t_s else None)
                    above.append(at_or_above(r["curve"], s["curve"]))
            entry["time_to_sync_last_ratio"] = ratios
            entry["at_or_above_sync"] = above
        out[variant] = entry
    return out


# -- TRL --------------------------------------------------------------------------------------
def run_trl(args: argparse.Namespace, warm: dict[str, Any], overrides: list[str], out: Path,
            timeout: float) -> dict[str, Any]:
    """``benchmarks/trl_grpo.py learn`` from the warmed model, in a process of its own (the first GPU
    alone): its eval curve (``rl_s`` without its evaluations), its summary, how it ended."""
    run_dir = out / "trl"
    recipe = [o for o in overrides if not o.startswith(("policy.model=", "warmup.steps="))]
    cmd = [sys.executable, args.trl_script, "learn", "--model", warm["model"], "--out", str(run_dir), "--config", args.config,
           *args.trl_args.split(), *(["--smoke", "--micro-batch", "8"] if args.cpu_smoke else []), "--set", *recipe]
    env = trl_env(args.trl_site)
    print(f"[{time.strftime('%H:%M:%S')}] TRL -> {run_dir} (limit {timeout:.0f} s)", flush=True)
    t0 = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(out / "trl.log", "w") as log:
        try:
            rc: Any = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    evals = run_dir / "evals.jsonl"
    rows = [json.loads(x) for x in evals.read_text().splitlines()] if evals.is_file() else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    return {"rc": rc, "wall_s": round(time.time() - t0, 1), "complete": rc == 0, "summary": summary,
            "curve": [{"step": r["step"], "eval_reward": r["eval_reward"], "rl_s": r["rl_s"]} for r in rows],
            "command": " ".join(cmd), "site": args.trl_site}


def trl_verdict(xrlhf: list[dict[str, Any]], trl: list[dict[str, Any]]) -> dict[str, Any]:
    """TRL's last eval reward, each side's RL clock at its first eval at or above it, and the
    ratio xrlhf / TRL (target <= 0.5). ``met`` is ``None`` where TRL's last eval is not above its
    first: there is nothing to reach (xrlhf's step-0 eval would reach it at 0 s)."""
    if not xrlhf or not trl:
        return {"target": None, "ratio": None, "met": None, "note": "a side has no eval points"}
    target = trl[-1]["eval_reward"]
    t_trl, t_x = time_to_reach(trl, target), time_to_reach(xrlhf, target)
    out = {"target": target, "trl_first": trl[0]["eval_reward"], "xrlhf_first": xrlhf[0]["eval_reward"],
           "trl_s": t_trl, "trl_total_s": trl[-1]["rl_s"], "xrlhf_s": t_x, "xrlhf_total_s": xrlhf[-1]["rl_s"],
           "xrlhf_last": xrlhf[-1]["eval_reward"], "target_ratio": TRL_TARGET}
    if target <= trl[0]["eval_reward"] or not t_trl:
        return {**out, "ratio": None, "met": None, "note": "TRL's last eval is not above its first: nothing to reach"}
    ratio = round(t_x / t_trl, 3) if t_x is not None else None
    return {**out, "ratio": ratio, "met": ratio is not None and ratio <= TRL_TARGET}


# -- figures ------------------------------------------------------------------------------------
def plot(curves: dict[str, list[dict[str, Any]]], path: Path, title: str, target: float | None = None,
         xlabel: str = "seconds of RL (start-up excluded)") -> Path:
    """Eval reward against the RL clock, one line per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in curves.items():
        ax.plot([p["rl_s"] for p in pts], [p["eval_reward"] for p in pts], marker="o", ms=3, label=label)
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=0.8, label="TRL's last eval")
    ax.set(title=title, xlabel=xlabel, ylabel="greedy eval reward")
    return save_figure(fig, ax, path)


def write_learning(args: argparse.Namespace, out: Path, runs_dir: Path, warm: dict[str, Any],
                   runs: list[dict[str, Any]], skipped: list[str]) -> dict[str, Any]:
    """``learning_gpu.json`` (the runs without their per-step train rewards) and its PNG."""
    slim = [{k: v for k, v in r.items() if k != "train_reward"} for r in runs]
    data = {"gpu": gpu_label(), "config": CONFIG, "margin": args.margin, "warmup": warm, "variants": summarize(slim),
            "runs": slim, "not_run": skipped, "png": "learning_gpu.png" if slim else None}
    write_json(runs_dir, "learning_gpu.json", data)
    if slim:
        plot({f"{r['variant']} seed {r['seed']}": steady(r["curve"]) for r in slim if r.get("curve")},
             out / "learning_gpu.png", f"GRPO on arithmetic word problems ({Path(args.config).name})",
             xlabel="seconds of RL (start-up and the first steps' compile excluded)")
    write_json(out, "learning_gpu.json", data)
    return data


# -- main ---------------------------------------------------------------------------------------
def learning(args: argparse.Namespace, runs_dir: Path, base: list[str], warm: dict[str, Any],
             budget: Budget) -> dict[str, Any]:
    """Every variant x seed (module docstring), the JSON written after each run."""
    kept = load_store(runs_dir)
    known = kept + load_every(runs_dir)  # what --reuse-runs may take
    new, skipped = [], []
    for variant in args.variant_list:
        for seed in args.seeds:
            overrides = rl_overrides(base, warm, variant, seed, args.rl_set)
            old = stored(known, variant, seed, overrides) if args.reuse_runs else None
            if old is not None:
                print(f"{variant} seed {seed}: kept from {old['run_dir']}", flush=True)
                new.append(judge(old, args.margin))
                continue
            if not budget.fits():
                skipped.append(f"{variant} seed {seed}")
                print(f"{variant} seed {seed}: not started, {budget.left():.0f} s left of --budget-s (the last run "
                      f"took {budget.last:.0f} s); run again with --reuse-runs to add it", flush=True)
                continue
            r = {**one_run(args, runs_dir, overrides, variant, seed), "rl_set": list(args.rl_set)}
            keep_run(runs_dir, r)
            budget.spent(r["wall_s"])
            new.append(r)
            write_learning(args, Path(args.out), runs_dir, warm, merge(kept, new), skipped)
    data = write_learning(args, Path(args.out), runs_dir, warm, merge(kept, new), skipped)
    for r in new:
        print(f"{r['variant']} seed {r['seed']}: {r['eval_before_rl']} -> {r['eval_last']}: rose by {r['rise']} "
              f"{'>=' if r['met'] else '<'} {args.margin}: {'yes' if r['met'] else 'NO'}", flush=True)
    return data


def beside_trl(args: argparse.Namespace, runs_dir: Path, base: list[str], warm: dict[str, Any],
               budget: Budget) -> dict[str, Any]:
    """TRL first (its time is the unknown: it gets what the budget leaves after an xrlhf run, judged
    at ``budget.last``), then xrlhf's sync run of the first seed; with ``--reuse-runs`` a kept one
    instead (then not from this call: ``xrlhf_same_call`` false)."""
    seed = args.seeds[0]
    overrides = rl_overrides(base, warm, "sync", seed, args.rl_set)
    mine = overrides + list(args.xrlhf_set)
    x = stored(load_store(runs_dir) + load_every(runs_dir), "sync", seed, mine) if args.reuse_runs else None
    left = budget.left() - (0 if x else budget.last)
    trl = run_trl(args, warm, overrides, Path(args.out), min(args.trl_timeout, left))
    same_call = x is None
    if x is None:
        x = {**one_run(args, runs_dir, mine, "sync", seed), "rl_set": list(args.rl_set) + list(args.xrlhf_set)}
        keep_run(runs_dir, x)
    verdict = trl_verdict(x.get("curve") or [], trl["curve"])
    data = {"gpu": gpu_label(), "config": CONFIG, "seed": seed, "warmup": warm, **verdict,
            "xrlhf": {k: v for k, v in x.items() if k != "train_reward"}, "xrlhf_same_call": same_call,
            "trl": trl, "png": "learning_vs_trl.png"}
    plot({"xrlhf (sync)": x.get("curve") or [], "TRL GRPOTrainer": trl["curve"]},
         Path(args.out) / "learning_vs_trl.png", "Time to reward: xrlhf beside TRL, same warmed model",
         verdict.get("target"))
    write_json(args.out, "learning_vs_trl.json", data)
    said = {True: "met", False: "NOT met", None: "no verdict"}[verdict.get("met")]
    print(f"TRL's last eval {verdict.get('target')} at {verdict.get('trl_s')} s (TRL exit {trl['rc']}); xrlhf "
          f"reaches it at {verdict.get('xrlhf_s')} s: ratio {verdict.get('ratio')} (target <= {TRL_TARGET}): {said}",
          flush=True)
    return data


def dry_run(args: argparse.Namespace, runs_dir: Path, base: list[str]) -> dict[str, Any]:
    """Each variant's config validated (as if vLLM were installed; the model may be a stand-in)."""
    import importlib.util
    from contextlib import nullcontext

    from benchmarks.async_grpo import as_if_installed
    from xrlhf.validation import load_config

    warm = {"model": next((o.split("=", 1)[1] for o in reversed(base) if o.startswith("policy.model=")), None)}
    stub = importlib.util.find_spec("vllm") is None and not args.cpu_smoke
    configs = {}
    with as_if_installed("vllm", "generate") if stub else nullcontext():
        configs["warmup"] = load_config(args.config, warmup_overrides(args.config, base))
        for variant in args.variant_list:
            configs[variant] = load_config(args.config, rl_overrides(base, warm, variant, args.seeds[0], args.rl_set))
    for name, cfg in configs.items():
        print(f"{name}: ok (warm-up {cfg.warmup.steps} steps, {cfg.trainer.steps} RL steps, staleness "
              f"{cfg.rollout.max_staleness}, generate {cfg.policy.generate.engine})")
    return {"configs": configs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    budget = Budget(args.budget_s, first_guess=30 if args.cpu_smoke else 150)
    runs_dir = Path(args.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    base = base_overrides(args, runs_dir)
    if args.rl_set == ["best"]:
        args.rl_set = best_rl_set(load_every(runs_dir))
        print(f"--rl-set best: {' '.join(args.rl_set) or '(the recipe as written)'}", flush=True)
    if args.dry_run:
        return dry_run(args, runs_dir, base)
    if not args.cpu_smoke:
        ensure_data(args)
        from benchmarks.common import ensure_model

        ensure_model(next(o.split("=", 1)[1] for o in reversed(base) if o.startswith("policy.model=")))
    warm = ensure_warmup(args, runs_dir, base)
    return (beside_trl if args.trl else learning)(args, runs_dir, base, warm, budget)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
