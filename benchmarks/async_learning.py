"""Does one-step-off asynchronous RL learn as well as the synchronous loop? (issue 14)

**CPU** (default): each config (``configs/grpo.yaml``, ``configs/quickstart.yaml``) and seed (0 1 2)
is run twice, synchronously and with ``rollout.max_staleness=1`` (plus ``algorithm.tis_cap=2.0``
where the algorithm has that off-policy correction and the config leaves it unset: PPO and
GRPO). Per run: the greedy eval reward before and after, the eval curve against samples seen
(step x prompts_per_step x samples_per_prompt) and the wall time. Per config: the mean and
standard deviation over seeds of the final eval reward, sync and async, and whether
async mean >= sync mean - sync std. Writes ``<out>/async_learning_cpu.json`` (runs of the same
config, steps, mode and seed replace earlier ones; the others are kept, so seeds may be run in
separate calls).

    python -m benchmarks.async_learning --out benchmarks/results                       # 12 runs
    python -m benchmarks.async_learning --configs configs/grpo.yaml --seeds 0 --steps 2 --warmup-steps 2

**GPU** (``--gpu``): GRPO on the reasoning env with the ``0.5b`` preset (``benchmarks.common.
ensure_model``), from ``configs/gpu/grpo_w.yaml`` with a learning rate that moves bf16 weights and
short answers. A supervised warm-up (as ``configs/grpo.yaml`` has, scaled to the model) runs once
in a process of its own; the sync and the async (k=1) run both start from its weights. Eval
reward against the RL clock (the sum of the steps' ``time/step_s``: start-up excluded, the
evaluations every ``--eval-every`` steps included, alike in both) in
``<out>/async_learning_gpu.png`` and ``<out>/async_learning_gpu.json``, with the time async needs
to reach sync's final eval reward and its ratio to sync's time (target <= 0.6).

    python -m benchmarks.async_learning --gpu --out benchmarks/results
    python -m benchmarks.async_learning --gpu --modes sync --runs-dir R ...; ... --modes async --runs-dir R
                              # the same in two calls: the second reuses R's warm-up and keeps sync's run
    python -m benchmarks.async_learning --gpu --dry-run        # the resolved configs (CPU is fine)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_CONFIGS = ["configs/grpo.yaml", "configs/quickstart.yaml"]
GPU_CONFIG = "configs/gpu/grpo_w.yaml"
CRITERION = "async mean >= sync mean - sync std (final greedy eval reward over seeds)"
GPU_TARGET_RATIO = 0.6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides applied to every run")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="CPU mode: configs to compare")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: each config's; GPU: 40)")
    p.add_argument("--warmup-steps", type=int, default=None, help="warm-up steps (default: each config's; GPU: 150)")
    p.add_argument("--model", default=None, help="the policy's model (CPU default: each config's; GPU: "
                   "artifacts/model-0.5b, built if missing)")
    p.add_argument("--modes", default="sync,async", help="which of sync,async to run")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--runs-dir", default=None, help="where the run directories go (default: a temporary one)")
    g = p.add_argument_group("GPU mode")
    g.add_argument("--gpu", action="store_true", help="the GPU comparison (one seed: the first of --seeds)")
    g.add_argument("--lr", type=float, default=2e-5, help="RL learning rate (bf16 weights: 1e-6 rounds away)")
    g.add_argument("--warmup-lr", type=float, default=2e-4)
    g.add_argument("--eval-every", type=int, default=5)
    g.add_argument("--dry-run", action="store_true", help="print the resolved configs; run nothing")
    args = p.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(args.mode_list) <= {"sync", "async"} or not args.mode_list:
        p.error(f"--modes: {args.modes!r}: a comma-separated subset of sync,async")
    return args


# -- shared ---------------------------------------------------------------------------------------
def async_overrides(path: Path, base: list[str]) -> list[str]:
    """``rollout.max_staleness=1``, plus ``algorithm.tis_cap=2.0`` when the algorithm has that
    off-policy correction and the config sets none (neither ``tis_cap`` nor ``off_policy``)."""
    from xrlhf.validation import algorithm_options, load_config

    out = ["rollout.max_staleness=1"]
    options = algorithm_options(load_config(path, base))
    has_tis = "tis_cap" in type(options).model_fields
    if has_tis and options.tis_cap is None and getattr(options, "off_policy", None) is None:
        out.append("algorithm.tis_cap=2.0")
    return out


def rl_clock(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> the RL clock at its end: the sum of ``time/step_s`` up to it (0 before RL)."""
    clock, t = {0: 0.0}, 0.0
    for r in rows:
        if r.get("step", 0) >= 1 and "time/step_s" in r:
            t += r["time/step_s"]
            clock[r["step"]] = round(t, 2)
    return clock


def curve(rows: list[dict[str, Any]], samples_per_step: int) -> list[dict[str, Any]]:
    """The eval points of a run: step, samples seen, eval reward and the RL clock."""
    clock = rl_clock(rows)
    return [{"step": r["step"], "samples": r["step"] * samples_per_step, "eval_reward": r["eval/reward_mean"],
             "rl_s": clock.get(r["step"], max(clock.values()))}
            for r in rows if "eval/reward_mean" in r and "step" in r]


def run_one(path: Path, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One run of ``path`` with ``overrides`` in ``run_dir``: its figures (``error`` if it failed)."""
    from xrlhf.report import read_metrics
    from xrlhf.runner import run
    from xrlhf.validation import load_config

    cfg = load_config(path, overrides)
    per_step = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    t0 = time.time()
    error, summary = None, {}
    try:
        summary = run(cfg, run_dir)
    except Exception as e:  # noqa: BLE001 - recorded, the next run still goes
        error = f"{type(e).__name__}: {e}"
        import traceback

        traceback.print_exc()
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    stale = [r["staleness/mean"] for r in steps if "staleness/mean" in r]
    clock = rl_clock(rows)
    return {"steps": cfg.trainer.steps, "samples_per_step": per_step, "overrides": overrides,
            "eval_initial": summary.get("eval_reward_initial"), "eval_final": summary.get("eval_reward_final"),
            "eval_before_warmup": summary.get("eval_reward_before_warmup"),
            "wall_s": round(time.time() - t0, 1), "rl_s": round(sum(r["time/step_s"] for r in steps), 1),
            "staleness_mean": round(statistics.mean(stale), 3) if stale else None,
            "reward_train_last": steps[-1]["reward/mean"] if steps else None,
            "curve": curve(rows, per_step),
            "train_reward": [[r["step"], clock[r["step"]], r["reward/mean"]] for r in steps],
            "run_dir": str(run_dir), "error": error}


def stats(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for one value)."""
    if not xs:
        return None, None
    return round(statistics.mean(xs), 4), round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config and step count: sync and async final eval reward over seeds, and the verdict."""
    out = []
    for key in dict.fromkeys((r["config"], r["steps"]) for r in runs):
        mine = [r for r in runs if (r["config"], r["steps"]) == key and r["error"] is None]
        entry: dict[str, Any] = {"config": key[0], "steps": key[1]}
        for mode in ("sync", "async"):
            finals = [r["eval_final"] for r in mine if r["mode"] == mode and r["eval_final"] is not None]
            mean, std = stats(finals)
            walls = [r["wall_s"] for r in mine if r["mode"] == mode]
            entry[mode] = {"final_mean": mean, "final_std": std,
                           "seeds": [r["seed"] for r in mine if r["mode"] == mode],
                           "finals": finals, "wall_s_mean": round(statistics.mean(walls), 1) if walls else None,
                           "initial_mean": stats([r["eval_initial"] for r in mine if r["mode"] == mode
                                                  and r["eval_initial"] is not None])[0]}
        s, a = entry["sync"], entry["async"]
        entry["async_ok"] = (a["final_mean"] >= s["final_mean"] - s["final_std"]
                             if a["final_mean"] is not None and s["final_mean"] is not None else None)
        out.append(entry)
    return out


def write(out_dir: Path, name: str, data: dict[str, Any]) -> Path:
    from benchmarks.common import write_json

    return write_json(out_dir, name, data)


# -- CPU ------------------------------------------------------------------------------------------
def model_override(path: Path, args: argparse.Namespace) -> list[str]:
    """``policy.model``: ``--model``, else the config's; a missing ``artifacts/tiny-char`` is built."""
    from benchmarks.common import ROOT, ensure_model
    from xrlhf.config.loader import read_yaml

    if args.model:
        return [f"policy.model={Path(args.model).resolve()}"]
    model = Path(read_yaml(path)["policy"]["model"])
    model = model if model.is_absolute() else ROOT / model
    if model.name == "tiny-char" and not (model / "config.json").is_file():
        print(f"building {model} (the tiny preset)", flush=True)
        ensure_model(model, preset="tiny", dtype="float32")
    return [f"policy.model={model}"]


def cpu_main(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import ROOT

    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="async_learning-"))
    new = []
    total = len(args.configs) * len(args.seeds) * len(args.mode_list)
    for name in args.configs:
        path = ROOT / name
        base = model_override(path, args) + ["trainer.save_final=false"]
        base += [f"trainer.steps={args.steps}"] if args.steps else []
        base += [f"warmup.steps={args.warmup_steps}"] if args.warmup_steps is not None else []
        base += list(args.overrides)
        for seed in args.seeds:
            for mode in args.mode_list:
                overrides = [*base, f"seed={seed}"]
                overrides += async_overrides(path, overrides) if mode == "async" else []
                run_dir = runs_dir / f"{Path(name).stem}-{mode}-s{seed}"
                print(f"[{time.strftime('%H:%M:%S')}] run {len(new) + 1}/{total}: {name} {mode} seed {seed} -> "
                      f"{run_dir}", flush=True)
                r = {"config": name, "mode": mode, "seed": seed, **run_one(path, overrides, run_dir)}
                new.append(r)
                print(f"[{time.strftime('%H:%M:%S')}] {name} {mode} seed {seed}: eval {r['eval_initial']} -> "
                      f"{r['eval_final']} in {r['wall_s']} s" + (f"; ERROR {r['error']}" if r["error"] else ""),
                      flush=True)
                save_cpu(Path(args.out), new)
    return save_cpu(Path(args.out), new)


def save_cpu(out_dir: Path, new: list[dict[str, Any]]) -> dict[str, Any]:
    """``async_learning_cpu.json``: earlier runs kept unless ``new`` has the same config, steps,
    mode and seed; the per-config verdicts recomputed over all."""
    import os

    path = out_dir / "async_learning_cpu.json"
    old = json.loads(path.read_text()).get("runs", []) if path.is_file() else []
    key = lambda r: (r["config"], r["steps"], r["mode"], r["seed"])  # noqa: E731
    replaced = {key(r) for r in new}
    runs = [r for r in old if key(r) not in replaced] + new
    data = {"mode": "cpu", "criterion": CRITERION, "machine": f"{os.cpu_count()} CPU cores (shared)",
            "configs": aggregate(runs), "runs": runs}
    write(out_dir, path.name, data)
    return data


# -- GPU ------------------------------------------------------------------------------------------
def gpu_overrides(args: argparse.Namespace, model: str) -> dict[str, list[str]]:
    """The overrides of ``configs/gpu/grpo_w.yaml`` for the warm-up and for each mode's RL run
    (the RL runs' ``policy.model`` is the warm-up's result, filled in later)."""
    seed = args.seeds[0]
    common = [f"seed={seed}", "env.options.tasks=[add, compare, sort]", "env.options.max_operand=20",
              "trainer.eval_size=256", "trainer.eval_temperature=0", "trainer.save_final=false",
              "policy.generate.max_new_tokens=64", "policy.generate.temperature=1.0"]
    warmup = [f"policy.model={model}", *common, f"warmup.steps={args.warmup_steps or 150}", "warmup.batch_size=64",
              f"warmup.lr={args.warmup_lr}", "trainer.eval_size=64",
              # the eval before the warm-up on the Transformers engine: no vLLM start-up for a 0-reward model
              'policy.generate={"engine": "hf", "dtype": "bfloat16", "max_new_tokens": 64}']
    rl = [*common, f"trainer.steps={args.steps or 40}", f"trainer.eval_every={args.eval_every}", "warmup.steps=0",
          f"policy.train.lr={args.lr}", *args.overrides]
    return {"warmup": warmup + list(args.overrides), "sync": rl,
            "async": [*rl, "rollout.max_staleness=1", "policy.generate.sleep_level=0"]}


def warm_up(overrides: list[str], out_dir: str) -> str:
    """The supervised warm-up of ``configs/gpu/grpo_w.yaml`` + ``overrides``: the directory of
    the warmed-up model. Runs in a process of its own (``multiprocessing`` spawn), so that its
    CUDA memory is gone before the RL runs start."""
    from benchmarks.common import ROOT
    from xrlhf.algorithms.warmup import supervised_warmup
    from xrlhf.data.text import load_tokenizer
    from xrlhf.envs import build_env
    from xrlhf.validation import load_config

    cfg = load_config(ROOT / GPU_CONFIG, overrides)
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    path, before = supervised_warmup(cfg, env, load_tokenizer(cfg.policy.model), cfg.policy.model, Path(out_dir))
    Path(out_dir, "warmup.json").write_text(json.dumps({"model": path, **before}))
    return path


def time_to_reach(points: list[dict[str, Any]], target: float) -> float | None:
    """The RL clock of the first eval point at or above ``target`` (None if none is)."""
    return next((p["rl_s"] for p in points if p["eval_reward"] >= target), None)


def plot_gpu(runs: dict[str, dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"sync": "tab:blue", "async": "tab:orange"}
    for mode, r in runs.items():
        pts = r["curve"]
        label = "synchronous" if mode == "sync" else "one-step-off (max_staleness 1)"
        ax.plot([p["rl_s"] for p in pts], [p["eval_reward"] for p in pts], marker="o", color=colors[mode],
                label=f"{label}: eval (greedy)")
        if r["train_reward"]:
            _, xs, ys = zip(*r["train_reward"])
            ax.plot(xs, ys, color=colors[mode], alpha=0.35, lw=0.8, label=f"{mode}: train reward (sampled)")
    ax.set(title="GRPO on the 0.5b preset: reward against the RL clock", xlabel="seconds of RL (start-up excluded)",
           ylabel="reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import MODEL_05B, ROOT, ensure_model

    if args.dry_run:
        return gpu_dry_run(args)
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="async_learning_gpu-"))
    model = ensure_model(args.model or MODEL_05B)
    over = gpu_overrides(args, model)
    warmup = warm_up_once(over["warmup"], runs_dir, args.warmup_steps or 150)
    path = Path(args.out) / "async_learning_gpu.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    same = old.get("warmup", {}).get("model") == warmup["model"]  # the other mode's run, from an earlier call
    runs = dict(old.get("runs", {})) if same else {}
    for mode in args.mode_list:
        overrides = [f"policy.model={warmup['model']}", *over[mode]]
        print(f"[{time.strftime('%H:%M:%S')}] {mode} run", flush=True)
        run_dir = runs_dir / f"{mode}-{time.strftime('%H%M%S')}"
        runs[mode] = {"mode": mode, **run_one(ROOT / GPU_CONFIG, overrides, run_dir)}
        r = runs[mode]
        print(f"[{time.strftime('%H:%M:%S')}] {mode}: eval {r['eval_initial']} -> {r['eval_final']}, RL {r['rl_s']} s"
              + (f"; ERROR {r['error']}" if r["error"] else ""), flush=True)
    data = gpu_verdict(runs)
    data.update({"gpu": gpu_label(), "config": GPU_CONFIG, "warmup": warmup, "seed": args.seeds[0], "runs": runs,
                 "png": "async_learning_gpu.png" if runs else None})
    if runs:
        plot_gpu(runs, Path(args.out) / "async_learning_gpu.png")
    write(Path(args.out), path.name, data)
    print(f"sync final eval {data['sync_final']}; async reaches it at {data['async_time_to_sync_final_s']} s of RL "
          f"(sync: {data.get('sync_time_s')} s): ratio {data['ratio']} (target <= {GPU_TARGET_RATIO})", flush=True)
    return data


def warm_up_once(overrides: list[str], runs_dir: Path, steps: int) -> dict[str, Any]:
    """The warm-up in ``runs_dir`` (a process of its own), or the one an earlier call left there."""
    done = runs_dir / "warmup.json"
    if done.is_file():
        print(f"warm-up: reusing {done}", flush=True)
        return json.loads(done.read_text())
    print(f"[{time.strftime('%H:%M:%S')}] warm-up ({steps} steps) -> {runs_dir / 'warmup'}", flush=True)
    t0 = time.time()
    proc = multiprocessing.get_context("spawn").Process(target=warm_up, args=(overrides, str(runs_dir)))
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not done.is_file():
        raise SystemExit(f"async_learning: the warm-up failed (exit code {proc.exitcode}); see the log above")
    info = {**json.loads(done.read_text()), "seconds": round(time.time() - t0, 1)}
    done.write_text(json.dumps(info))
    return info


def gpu_verdict(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Sync's final eval reward, the RL time async needs to reach it, and the ratio to sync's time."""
    s, a = runs.get("sync"), runs.get("async")
    if not s or not a or s["error"] or a["error"] or not s["curve"]:
        return {"sync_final": None, "async_time_to_sync_final_s": None, "ratio": None, "target_ratio": GPU_TARGET_RATIO,
                "met": None}
    target = s["curve"][-1]["eval_reward"]
    t_sync = time_to_reach(s["curve"], target)
    t_async = time_to_reach(a["curve"], target)
    ratio = round(t_async / t_sync, 3) if t_async is not None and t_sync else None
    return {"sync_final": target, "sync_time_s": t_sync, "sync_total_s": s["curve"][-1]["rl_s"],
            "async_final": a["curve"][-1]["eval_reward"],
            "async_time_to_sync_final_s": t_async, "ratio": ratio, "target_ratio": GPU_TARGET_RATIO,
            "met": ratio is not None and ratio <= GPU_TARGET_RATIO,
            "note": "times: the RL clock (sum of time/step_s, evaluations included) at the first eval at or above "
                    "sync's final eval reward; sync's own time is when it first reached it"}


def gpu_label() -> str:
    import subprocess

    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "none"
    return names.strip()


def gpu_dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """Print and validate the warm-up's and each mode's config (as if vLLM were installed, with a
    stand-in model when the 0.5b one is missing): nothing runs."""
    import importlib.util
    from contextlib import nullcontext

    from benchmarks.async_grpo import as_if_installed, stand_in_model
    from benchmarks.common import MODEL_05B, ROOT
    from xrlhf.config.loader import dump_config
    from xrlhf.validation import load_config

    model = str(Path(args.model or MODEL_05B).resolve())
    if not (Path(model) / "config.json").is_file():
        model = stand_in_model()
        print(f"no model at {args.model or MODEL_05B}: validated against a stand-in, {model}")
    over = gpu_overrides(args, model)
    stub = importlib.util.find_spec("vllm") is None
    configs = {}
    with as_if_installed("vllm", "generate") if stub else nullcontext():
        for name, overrides in over.items():
            if name != "warmup":
                overrides = [f"policy.model={model}", *overrides]  # the warm-up's result, when it runs
            configs[name] = load_config(ROOT / GPU_CONFIG, overrides)
            print(f"# ---- {name}: overrides {' '.join(overrides)}\n{dump_config(configs[name])}")
    return {"overrides": over, "configs": configs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    return gpu_main(args) if args.gpu else cpu_main(args)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
