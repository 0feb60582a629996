"""Does it learn on a CPU, over seeds, per algorithm and run shape? Four suites, one command each.

Each suite writes its table as JSON in benchmarks/results/ (which docs/benchmarks.md and
docs/algorithms.md read).

``async`` (issue 14): one-step-off asynchronous RL against the synchronous loop. Each config
(``configs/grpo.yaml``, ``configs/quickstart.yaml``) and seed (0 1 2) is run twice, synchronously
and with ``rollout.max_staleness=1`` (plus ``algorithm.tis_cap=2.0`` where the algorithm has that
off-policy correction and the config leaves it unset: PPO and GRPO). Per run: the greedy eval
reward before and after, the eval curve against samples seen (step x prompts_per_step x
samples_per_prompt) and the wall time; per config: the mean and standard deviation over seeds of
the final eval reward, sync and async, and whether async mean >= sync mean - sync std.
``<out>/async_learning_cpu.json`` (runs of the same config, steps, mode and seed replace earlier
ones; the others are kept, so seeds may be run in separate calls). ``--gpu``: the same question on
one GPU (GRPO, the ``0.5b`` preset, ``configs/gpu/grpo_w.yaml``; a supervised warm-up once in a
process of its own, both runs start from its weights): eval reward against the RL clock (the sum of
the steps' ``time/step_s``, evaluations included) in ``<out>/async_learning_gpu.{json,png}``, with
the time async needs to reach sync's final eval reward and its ratio to sync's (target <= 0.6).

    python -m benchmarks.learning_cpu async --out benchmarks/results                       # 12 runs
    python -m benchmarks.learning_cpu async --configs configs/grpo.yaml --seeds 0 --steps 2 --warmup-steps 2
    python -m benchmarks.learning_cpu async --gpu --out benchmarks/results
    python -m benchmarks.learning_cpu async --gpu --modes sync --runs-dir R ...; ... --modes async --runs-dir R
                              # the same in two calls: the second reuses R's warm-up and keeps sync's run
    python -m benchmarks.learning_cpu async --gpu --dry-run    # the resolved configs (CPU is fine)

``episodes`` (issue 15): do the episode envs learn, and does the calculator tool pay?
``configs/tool_calc.yaml`` as shipped, the same without the tool (``env.options.tools=[]``) and
``configs/multiturn_qa.yaml``, each once per seed (0 unless ``--seeds``): eval before and after,
its curve, accuracy, first-try accuracy, tool calls per episode, truncation, wall time.
``<out>/episodes_cpu.json``.

    python -m benchmarks.learning_cpu episodes --out benchmarks/results
    python -m benchmarks.learning_cpu episodes --runs tool_calc --steps 2 --warmup-steps 2   # smoke

``distill`` (issues 26, 27): the teacher built once by ``configs/distill_teacher.yaml`` (seed 0),
then ``configs/distill.yaml`` for each student seed: the greedy eval curve, the final reward and its
share of the teacher's, the reverse KL at the start and the end. ``<out>/distill_cpu.json``
(``distill_cpu_<name>.json`` with ``--name``); GRPO from the same start is the async suite's sync.

    python -m benchmarks.learning_cpu distill --seeds 0 1 2 --out benchmarks/results   # ~25 min on 2 cores
    python -m benchmarks.learning_cpu distill --steps 2 --teacher-warmup-steps 2 --out /tmp/d  # smoke
    python -m benchmarks.learning_cpu distill --name topk32 algorithm.topk_coef=1.0 teacher.infer.topk_logprobs=32

``seeds`` (issue 26): every CPU config docs/algorithms.md, docs/lora.md, docs/async.md and
docs/deepspeed.md give a learning figure for, ``xrlhf run CONFIG seed=SEED`` one run at a time:
eval after the warm-up and after the last step (``rm``: held-out pairwise accuracy; ``qa_ppo``: the
reward model's score, its reward model trained once with seed 0 into ``runs/rm``), wall time and
load; per config the mean and sample std. ``make data`` first. ``--out`` is a file.

    python -m benchmarks.learning_cpu seeds --seeds 0 1 2 --out benchmarks/results/learning_seeds.json
    python -m benchmarks.learning_cpu seeds --configs quickstart --seeds 0 1 2 3 4 --runs-dir runs \\
        --out benchmarks/results/quickstart_seeds.json        # the README's quickstart table
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (MODEL_05B, ROOT, ensure_model, gpu_label, run_one, save_figure, stats, time_to_reach,
                               write_json)

DEFAULT_CONFIGS = ["configs/grpo.yaml", "configs/quickstart.yaml"]
GPU_CONFIG = "configs/gpu/grpo_w.yaml"
CRITERION = "async mean >= sync mean - sync std (final greedy eval reward over seeds)"
GPU_TARGET_RATIO = 0.6
EPISODE_RUNS = {"tool_calc": ("configs/tool_calc.yaml", []),
                "tool_calc_no_tool": ("configs/tool_calc.yaml", ["env.options.tools=[]"]),
                "multiturn_qa": ("configs/multiturn_qa.yaml", [])}
SEED_CONFIGS = ["dpo", "kto_offline", "kto_online", "rm", "qa_ppo", "grpo_lora", "grpo_async", "quickstart_deepspeed"]


# -- the command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``SUITE [options] [overrides]``; ``args.argv`` keeps the words (for the JSON's command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="suite", required=True, metavar="{async,episodes,distill,seeds}")
    for name, add, what in (("async", async_args, "one step off against synchronous (CPU; --gpu: one GPU)"),
                            ("episodes", episodes_args, "the episode envs, the calculator tool against none"),
                            ("distill", distill_args, "the distillation recipe over student seeds"),
                            ("seeds", seeds_args, "every CPU config with a learning figure in the docs, over seeds")):
        add(sub.add_parser(name, help=what, description=what))
    args = p.parse_args(argv)
    args.argv = argv
    if args.suite == "async":
        args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not set(args.mode_list) <= {"sync", "async"} or not args.mode_list:
            p.error(f"--modes: {args.modes!r}: a comma-separated subset of sync,async")
    return args


def async_args(p: argparse.ArgumentParser) -> None:
    """The ``async`` suite's options (the GPU comparison's in a group of their own)."""
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


def episodes_args(p: argparse.ArgumentParser) -> None:
    """The ``episodes`` suite's options."""
    p.add_argument("overrides", nargs="*", help="dotted config overrides applied to every run")
    p.add_argument("--runs", nargs="+", default=list(EPISODE_RUNS), choices=list(EPISODE_RUNS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--model", default=None, help="the policy's model (default: each config's)")


def distill_args(p: argparse.ArgumentParser) -> None:
    """The ``distill`` suite's options."""
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every student run")
    p.add_argument("--name", default=None, help="write distill_cpu_<name>.json (default: distill_cpu.json)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the student's seeds")
    p.add_argument("--steps", type=int, default=None, help="the student's steps (default: the config's)")
    p.add_argument("--teacher-warmup-steps", type=int, default=None, help="default: the teacher config's")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--runs-dir", default=None)


def seeds_args(p: argparse.ArgumentParser) -> None:
    """The ``seeds`` suite's options (``--out``: a file)."""
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", nargs="+", default=SEED_CONFIGS)
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "learning-seeds")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "learning_seeds.json")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides for every run (retuning a config); the runs go to RUNS/<name>+<overrides>")


def command(args: argparse.Namespace) -> str:
    """The command line that ran, as the JSON records it."""
    return " ".join(["python -m benchmarks.learning_cpu", *args.argv])


def model_override(path: Path, args: argparse.Namespace) -> list[str]:
    """``policy.model``: ``--model``, else the config's; a missing ``artifacts/tiny-char`` is built."""
    from xrlhf.config.loader import read_yaml

    if args.model:
        return [f"policy.model={Path(args.model).resolve()}"]
    model = Path(read_yaml(path)["policy"]["model"])
    model = model if model.is_absolute() else ROOT / model
    if model.name == "tiny-char" and not (model / "config.json").is_file():
        print(f"building {model} (the tiny preset)", flush=True)
        ensure_model(model, preset="tiny", dtype="float32")
    return [f"policy.model={model}"]


# -- async: CPU -----------------------------------------------------------------------------------
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


def async_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """``async`` on CPU: each config x seed x mode, the JSON rewritten after every run."""
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="learning_cpu-async-"))
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
    path = out_dir / "async_learning_cpu.json"
    old = json.loads(path.read_text()).get("runs", []) if path.is_file() else []
    key = lambda r: (r["config"], r["steps"], r["mode"], r["seed"])  # noqa: E731
    replaced = {key(r) for r in new}
    runs = [r for r in old if key(r) not in replaced] + new
    data = {"mode": "cpu", "criterion": CRITERION, "machine": f"{os.cpu_count()} CPU cores (shared)",
            "configs": aggregate(runs), "runs": runs}
    write_json(out_dir, path.name, data)
    return data


# -- async: GPU -----------------------------------------------------------------------------------
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
    from xrlhf.algorithms.warmup import supervised_warmup
    from xrlhf.data.text import load_tokenizer
    from xrlhf.envs import build_env
    from xrlhf.validation import load_config

    cfg = load_config(ROOT / GPU_CONFIG, overrides)
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    path, before = supervised_warmup(cfg, env, load_tokenizer(cfg.policy.model), cfg.policy.model, Path(out_dir))
    Path(out_dir, "warmup.json").write_text(json.dumps({"model": path, **before}))
    return path


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
        raise SystemExit(f"learning_cpu async --gpu: the warm-up failed (exit code {proc.exitcode}); see the log above")
    info = {**json.loads(done.read_text()), "seconds": round(time.time() - t0, 1)}
    done.write_text(json.dumps(info))
    return info


def plot_gpu(runs: dict[str, dict[str, Any]], path: Path) -> Path:
    """Eval (greedy) and train reward against the RL clock, sync and async, as a PNG at ``path``."""
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
    return save_figure(fig, ax, path)


def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    """``async --gpu``: the warm-up once, then each of ``--modes`` from its weights; the verdict."""
    if args.dry_run:
        return gpu_dry_run(args)
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="learning_cpu-async-gpu-"))
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
    write_json(Path(args.out), path.name, data)
    print(f"sync final eval {data['sync_final']}; async reaches it at {data['async_time_to_sync_final_s']} s of RL "
          f"(sync: {data.get('sync_time_s')} s): ratio {data['ratio']} (target <= {GPU_TARGET_RATIO})", flush=True)
    return data


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


def gpu_dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """Print and validate the warm-up's and each mode's config (as if vLLM were installed, with a
    stand-in model when the 0.5b one is missing): nothing runs."""
    import importlib.util
    from contextlib import nullcontext

    from benchmarks.async_grpo import as_if_installed, stand_in_model
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


def async_suite(args: argparse.Namespace) -> int:
    """``async``: the CPU comparison, or with ``--gpu`` the GPU one; 0 (a failed run is in the JSON)."""
    if args.gpu:
        gpu_main(args)
    else:
        async_cpu(args)
    return 0


# -- episodes -------------------------------------------------------------------------------------
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


def episodes_suite(args: argparse.Namespace) -> int:
    """``episodes``: each run x seed, the JSON rewritten after every run; 1 if a run failed."""
    from xrlhf.report import read_metrics

    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="learning_cpu-episodes-"))
    results = []
    for name in args.runs:
        config, extra = EPISODE_RUNS[name]
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
                    "command": command(args), "runs": results, "summary": episodes_summary(results)}
            write_json(Path(args.out), "episodes_cpu.json", data)  # after every run: a cut-off sweep keeps its runs
    print(Path(args.out) / "episodes_cpu.json")
    return 0 if all(r["error"] is None for r in results) else 1


def episodes_summary(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run name over its seeds: eval before and after RL (mean, sample std, each seed's) and the gain."""
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


# -- distill --------------------------------------------------------------------------------------
def kl_ends(run_dir: Path) -> tuple[float | None, float | None]:
    """The mean per-token reverse KL of the first and of the last 20 steps."""
    from xrlhf.report import read_metrics

    kl = [r["distill/reverse_kl"] for r in read_metrics(run_dir) if "distill/reverse_kl" in r]
    if not kl:
        return None, None
    return round(statistics.mean(kl[:20]), 3), round(statistics.mean(kl[-20:]), 3)


def distill_suite(args: argparse.Namespace) -> int:
    """``distill``: the teacher once, then each student seed; 1 if a run failed."""
    runs = Path(args.runs_dir or tempfile.mkdtemp(prefix="learning_cpu-distill-"))
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
    data = {"machine": "CPU (2 cores)", "date": time.strftime("%Y-%m-%d"), "command": command(args),
            "teacher": {k: teacher[k] for k in ("eval_initial", "eval_final", "eval_before_warmup", "wall_s")},
            "students": students, "student_final_mean": mean, "student_final_std": std,
            "share_of_teacher_mean": round(mean / teacher["eval_final"], 3) if mean and teacher["eval_final"] else None}
    data["student_overrides"] = args.overrides
    print(write_json(Path(args.out), f"distill_cpu{'_' + args.name if args.name else ''}.json", data))
    return 0 if all(r["error"] is None for r in students) else 1


# -- seeds ----------------------------------------------------------------------------------------
def one_seed(seed: int, runs_dir: Path, config: str, overrides: tuple[str, ...] = ()) -> dict:
    """One run of ``config`` with ``seed`` (and ``overrides``, ``key=value`` as the CLI takes them)
    into ``runs_dir/qs-SEED``: its greedy eval reward before and after the RL, and its times."""
    out = runs_dir / f"qs-{seed}"
    load0 = os.getloadavg()[0]
    t0 = time.time()
    cmd = [sys.executable, "-m", "xrlhf.cli", "run", config, "--output-dir", str(out), f"seed={seed}", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    initial, final = summary["eval_reward_initial"], summary["eval_reward_final"]
    return {"seed": seed, "initial": initial, "final": final, "gain": final - initial,
            "wall_s": summary["wall_seconds"], "process_s": time.time() - t0,
            "load_start": load0, "load_end": os.getloadavg()[0]}


def seeds_summary(rows: list[dict]) -> dict:
    """Seeds, and mean and sample std of the initial, final and gain over ``rows``."""
    out = {"seeds": [r["seed"] for r in rows]}
    for k in ("initial", "final", "gain"):
        values = [r[k] for r in rows]
        out[f"{k}_mean"] = round(statistics.mean(values), 4)
        out[f"{k}_std"] = round(statistics.stdev(values), 4) if len(values) > 1 else 0.0
    return out


def seeds_suite(args: argparse.Namespace) -> int:
    """``seeds``: ``xrlhf run`` per config and seed in a process of its own, the JSON after every run."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    data = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "commit": commit,
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.learning_cpu", *args.argv]),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "configs": {}}
    if "qa_ppo" in args.configs and not (ROOT / "runs" / "rm" / "final").is_dir():
        subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", "configs/rm.yaml", "--output-dir", "runs/rm"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    for name in args.configs:
        rows = []
        for seed in args.seeds:
            runs = args.runs_dir / "+".join([name, *args.set])
            row = one_seed(seed, runs, f"configs/{name}.yaml", tuple(args.set))
            rows.append({**row, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
            print(f"{name} seed {seed}: {row['initial']:.3f} -> {row['final']:.3f} ({row['gain']:+.3f}), "
                  f"{row['wall_s']:.0f} s", flush=True)
            data["configs"][name] = {"runs": rows, **seeds_summary(rows),
                                     **({"overrides": args.set} if args.set else {})}
            args.out.write_text(json.dumps(data, indent=1) + "\n")  # after every run: a cut run keeps the rest
    for name, c in data["configs"].items():
        print(f"{name}: {c['initial_mean']:.3f} -> {c['final_mean']:.3f} +- {c['final_std']:.3f} "
              f"(gain {c['gain_mean']:+.3f} +- {c['gain_std']:.3f})")
    return 0


SUITES = {"async": async_suite, "episodes": episodes_suite, "distill": distill_suite, "seeds": seeds_suite}


def main(argv: list[str] | None = None) -> int:
    """Run the suite ``argv`` names: its exit code (episodes, distill: 1 if a run failed)."""
    args = parse_args(argv)
    return SUITES[args.suite](args)


if __name__ == "__main__":
    sys.exit(main())
