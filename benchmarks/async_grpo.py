"""Synchronous against asynchronous GRPO on workload W (issue 14, docs/design/async-rl.md §3.12), and
the calculator env's episodes through vLLM, sync and one step off (``episodes``, below).

Runs ``configs/gpu/grpo_w.yaml`` once per variant, back to back in this process, each for
``--steps`` steps (8), and times steps ``--timed-from`` (3) .. the last:

* ``sync-colocated``: the config as it is (one GPU, vLLM sleeps while the trainer trains);
* ``async-colocated``: ``rollout.max_staleness=1``, vLLM awake (``sleep_level=0``) generating
  batch s+1 while step s trains, on the same GPU;
* ``sync-split`` / ``async-split``: vLLM on a GPU of its own (``policy.generate.resources``,
  ``ray.num_gpus=2``), weights broadcast over NCCL; skipped on a machine with one GPU.

``async<k>-<layout>`` runs staleness k. Per run: the median and mean step time, each phase's
median, the GPU busy share (nvidia-smi's utilisation every 50 ms, per GPU used, over the timed
steps), the device's peak memory, the observed staleness, the target and whether it is met;
an asynchronous run also gets the synchronous run of its layout beside it
(``sync_step_s_median``, ``speedup``). Targets: one GPU, staleness 1: <= 4.3 s/step and GPU busy
>= 85%; two GPUs: <= 3.5 s/step (baseline 6.80 s/step on one H200).

    python -m benchmarks.async_grpo --out benchmarks/results [--variants ...] [key.path=value ...]
    python -m benchmarks.async_grpo --dry-run      # the resolved configs, nothing run (CPU is fine)

Each variant takes ~2.5-4 minutes (Ray and vLLM start-up ~1-1.5, the evals before and after,
8 steps of ~4-7 s), so a pair fits one 10-minute call and all four do not: run
``--variants sync-colocated,async-colocated`` and ``--variants sync-split,async-split`` in two
calls with the same ``--out`` (the JSON is merged).

Writes ``<out>/async_grpo.json``, a list with one object per run; a later invocation replaces the
runs of the same GPU, layout and staleness and keeps the others (so the layouts may be measured
in separate calls). The timeline of the last steps of each run is drawn to
``<out>/async_grpo_timeline_<layout>.png`` (``..._<layout>_sync.png`` for the synchronous one).
Weight verification is off (``--verify`` keeps the config's), so ``sync_s`` is the transport's.

**Episodes** (``episodes``, issue 15): the calculator env with vLLM on the ``0.5b`` preset, sync
and one-step-off. One GPU, co-located (``configs/gpu/grpo_w.yaml``'s engines: vLLM generates, HF trains bf16),
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

    python -m benchmarks.async_grpo episodes --mode sync --out $OUT --runs-dir $OUT/runs
    python -m benchmarks.async_grpo episodes --mode async --from $OUT/runs/sync --out $OUT --runs-dir $OUT/runs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from xrlhf.algorithms import ALGORITHMS, RLTrainer

CONFIG = "configs/gpu/grpo_w.yaml"
DEFAULT_VARIANTS = "sync-colocated,async-colocated,sync-split,async-split"
BASELINE = {"step_s": 6.80, "generate_s": 3.44, "infer_s": 1.23, "train_s": 1.91, "sync_s": 0.08, "gpu_busy": 74.0}
"""W on one H200, synchronous, measured by the issue's outside check."""
TARGETS: dict[tuple[str, int], dict[str, float]] = {("colocated", 1): {"step_s": 4.3, "gpu_busy": 85.0},
                                                    ("split", 1): {"step_s": 3.5}}
PHASES = ["generate", "reward", "infer", "train", "update", "sync", "sleep", "wait_rollout", "wait_generation"]
SPLIT = ["ray.num_gpus=2", "policy.generate.resources.ranks=1", "policy.generate.resources.cpus_per_rank=2",
         "policy.generate.resources.gpus_per_rank=1", "policy.generate.gpu_memory_utilization=0.8",
         "policy.generate.sleep_level=0", "policy.generate.multiprocessing=true"]
"""The split layout: vLLM alone on a second GPU (so it may take most of it), never asleep; with vLLM's
engine process, as it was measured on two GPUs (the in-process default has not run there yet)."""


class BusyLoop(RLTrainer):
    """The online loop whose every step also reports each sampled GPU's busy share and peak memory
    (``gpu<i>/busy``, ``gpu<i>/peak_gib``), the samplers reset at the step's start; and where the
    driver reports clocks, their means while the step waited for its rollout (``gpu<i>/gen_sm_mhz``,
    ``_power_w``, ``_temp_c``, ``_slowed``: a synchronous step generates then) and over the rest of
    it (``gpu<i>/rest_...``): whether a slow generation ran on a slowed GPU."""

    samplers: list = []  # DeviceMemorySampler per GPU used, set by main() on the imported module

    def step(self) -> dict[str, float]:
        for s in self.samplers:
            s.reset()
        t0 = time.time()
        metrics = super().step()
        t1 = time.time()
        gen_end = t0 + float(metrics.get("time/wait_rollout_s") or 0.0)
        for i, s in enumerate(self.samplers):
            busy = s.utilization()
            if busy is not None:
                metrics[f"gpu{i}/busy"] = busy
            metrics[f"gpu{i}/peak_gib"] = s.peak()
            for part, (a, b) in (("gen", (t0, gen_end)), ("rest", (gen_end, t1))):
                metrics.update({f"gpu{i}/{part}_{k}": v for k, v in s.window(a, b).items()})
        return metrics



BusyGRPO = replace(ALGORITHMS.get("grpo"), loop=BusyLoop)
"""GRPO run by ``BusyLoop`` (``algorithm.name: benchmarks.async_grpo:BusyGRPO``)."""

# -- variants and their configs ---------------------------------------------------------------
def parse_variant(name: str) -> tuple[str, int]:
    """``sync-colocated`` -> ``("colocated", 0)``; ``async-split`` -> ``("split", 1)``; ``async2-...`` k=2."""
    m = re.fullmatch(r"(sync|async(\d*))-(colocated|split)", name)
    if m is None:
        raise SystemExit(f"--variants: {name!r} is not <sync|async|async<k>>-<colocated|split> "
                         f"(e.g. {DEFAULT_VARIANTS})")
    k = 0 if m.group(1) == "sync" else int(m.group(2) or 1)
    if m.group(1) != "sync" and k < 1:
        raise SystemExit(f"--variants: {name!r}: an asynchronous run needs staleness >= 1")
    return m.group(3), k


def variant_overrides(layout: str, k: int) -> list[str]:
    """What a variant changes in ``configs/gpu/grpo_w.yaml``."""
    out = list(SPLIT) if layout == "split" else []
    if k:  # vLLM must stay awake to generate while the trainer trains
        out += [f"rollout.max_staleness={k}", "policy.generate.sleep_level=0"]
    return out


def build_overrides(args: argparse.Namespace, model: str, layout: str, k: int) -> list[str]:
    """All the overrides of one variant's run, in the order they apply (the user's last)."""
    from benchmarks.common import cli_overrides

    out = [f"policy.model={model}", f"trainer.steps={args.steps}", "trainer.eval_every=0",
           f"trainer.eval_size={args.eval_size}", "trainer.save_final=false",
           "algorithm.name=benchmarks.async_grpo:BusyGRPO", "algorithm.advantage_estimator=grpo",
           *variant_overrides(layout, k), *cli_overrides()]
    if not args.verify:
        out.append("policy.weight_sync.verify=false")
    return out + list(args.overrides)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides applied to every variant")
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated, run in this order")
    p.add_argument("--model", default=None, help="default: artifacts/model-0.5b (built if missing)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timed-from", type=int, default=3, help="the first step timed (earlier ones warm up)")
    p.add_argument("--eval-size", type=int, default=16, help="held-out prompts evaluated before and after")
    p.add_argument("--verify", action="store_true", help="keep the config's weight_sync.verify")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--dry-run", action="store_true", help="print each variant's resolved config; run nothing")
    args = p.parse_args(argv)
    if args.timed_from > args.steps:
        p.error(f"--timed-from {args.timed_from} is after the last step (--steps {args.steps})")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variant_list:
        parse_variant(v)
    return args


def build_configs(args: argparse.Namespace, model: str) -> list[tuple[str, Any, list[str]]]:
    """``(variant, validated config, overrides)`` of every variant asked for."""
    from benchmarks.common import ROOT
    from xrlhf.validation import load_config

    out = []
    for name in args.variant_list:
        layout, k = parse_variant(name)
        overrides = build_overrides(args, model, layout, k)
        out.append((name, load_config(ROOT / args.config, overrides), overrides))
    return out


@contextmanager
def as_if_installed(engine: str, role: str):
    """Validation as if ``engine``'s packages were installed (a dry run on a CPU machine without
    vLLM: every other check still runs)."""
    from unittest import mock

    from xrlhf.engines.base import engine_class

    cls = engine_class(engine, role)
    with mock.patch.object(cls, "missing_packages", classmethod(lambda c: [])):
        yield


def stand_in_model() -> str:
    """A dry run without the 0.5b model: the ``small`` preset (4M parameters, 512 positions, built
    in seconds) in a temporary directory, so that the configs are validated as a run would."""
    from xrlhf.models.tiny import PRESETS, build_model

    path = Path(tempfile.mkdtemp(prefix="async_grpo-stand-in-"))
    build_model(path, **PRESETS["small"])
    return str(path)


# -- the machine --------------------------------------------------------------------------------
def gpus() -> list[dict[str, Any]]:
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES``), from nvidia-smi: no CUDA context
    is made here, so the driver holds no GPU memory. Empty without nvidia-smi."""
    try:
        lines = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.total",
                                "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return []
    keys = ("index", "uuid", "name", "total_gib")
    found = [dict(zip(keys, (x.strip() for x in ln.split(",")))) for ln in lines if ln]
    for g in found:
        g["total_gib"] = round(float(g["total_gib"]) / 1024, 1)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    keep = [v.strip() for v in visible.split(",") if v.strip()]
    return [g for v in keep for g in found if v in (g["index"], g["uuid"])]


# -- one run --------------------------------------------------------------------------------------
def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summarize(rows: list[dict[str, Any]], timed_from: int, n_gpus: int) -> dict[str, Any]:
    """The figures of one run from its ``metrics.jsonl`` rows (the RL steps ``timed_from``..)."""
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    timed = [r for r in steps if r["step"] >= timed_from]
    if any(r.get("staleness/max", 0) >= 1 for r in steps) and len(timed) > 1:
        # one step off: the last step has no next batch to generate beside it (W: 1.6 s against ~4),
        # so it is no steady-state step (until 2026-11-26 it was timed, flattering these runs)
        timed = timed[:-1]
    step_s = [r["time/step_s"] for r in timed]
    phases = {p: median([r[f"time/{p}_s"] for r in timed if r.get(f"time/{p}_s") is not None]) for p in PHASES}
    weights = sum(step_s) or 1.0
    busy = []
    for i in range(n_gpus):  # the busy share over the timed steps: each step's weighted by its length
        pts = [(r[f"gpu{i}/busy"], r["time/step_s"]) for r in timed if r.get(f"gpu{i}/busy") is not None]
        busy.append(round(sum(b * s for b, s in pts) / (sum(s for _, s in pts) or weights), 1) if pts else None)
    peaks = [max((r.get(f"gpu{i}/peak_gib") or 0.0 for r in steps), default=0.0) or None for i in range(n_gpus)]
    stale = [r for r in timed if "staleness/mean" in r]
    evals = [r for r in rows if "eval/reward_mean" in r]
    return {
        "steps": len(steps), "timed_steps": [r["step"] for r in timed],
        "step_s_median": median(step_s), "step_s_mean": round(statistics.mean(step_s), 3) if step_s else None,
        "phases_median": {k: v for k, v in phases.items() if v is not None},
        "gpu_busy": round(statistics.mean(b for b in busy if b is not None), 1) if any(b is not None for b in busy)
        else None,
        "gpu_busy_per_gpu": busy,
        "peak_gib": round(max(p for p in peaks if p), 2) if any(peaks) else None,
        "peak_gib_per_gpu": [round(p, 2) if p else None for p in peaks],
        "staleness_observed": {"min": min(r["staleness/min"] for r in stale),
                               "mean": round(statistics.mean(r["staleness/mean"] for r in stale), 3),
                               "max": max(r["staleness/max"] for r in stale)} if stale else None,
        "reward_mean_last": steps[-1]["reward/mean"] if steps else None,
        "eval_reward_first": evals[0]["eval/reward_mean"] if evals else None,
        "eval_reward_last": evals[-1]["eval/reward_mean"] if evals else None,
        "mismatch_mean": median([r["mismatch/logprob_abs_diff_mean"] for r in timed
                                 if r.get("mismatch/logprob_abs_diff_mean") is not None]),
        "tokens_per_s_per_gpu": median([r["perf/tokens_per_s_per_gpu"] for r in timed
                                        if r.get("perf/tokens_per_s_per_gpu") is not None]),
        "train_mfu": median([r["perf/train_mfu"] for r in timed if r.get("perf/train_mfu") is not None]),
        "per_step": [{"step": r["step"], "step_s": round(r["time/step_s"], 3),
                      **{p: round(r[f"time/{p}_s"], 3) for p in PHASES if r.get(f"time/{p}_s") is not None},
                      **{k: r[k] for k in r if k.startswith("gpu") or k.startswith("staleness/")}} for r in steps],
    }


def judge(entry: dict[str, Any]) -> None:
    """Adds ``target`` and ``met`` (None where the layout and staleness have no target)."""
    target = TARGETS.get((entry["layout"], entry["staleness"]))
    entry["target"] = target
    if target is None or entry.get("step_s_median") is None:
        entry["met"] = None
        return
    ok = entry["step_s_median"] <= target["step_s"]
    if "gpu_busy" in target:
        ok = ok and entry.get("gpu_busy") is not None and entry["gpu_busy"] >= target["gpu_busy"]
    entry["met"] = bool(ok)


def pair_with_sync(entries: list[dict[str, Any]]) -> None:
    """Each asynchronous entry gets the synchronous run of its GPU and layout beside it."""
    sync = {(e["gpu"], e["layout"]): e for e in entries if e["staleness"] == 0 and e.get("step_s_median")}
    for e in entries:
        if e["staleness"] == 0:
            continue
        s = sync.get((e["gpu"], e["layout"]))
        e["sync_step_s_median"] = s["step_s_median"] if s else None
        e["speedup"] = round(s["step_s_median"] / e["step_s_median"], 2) if s and e.get("step_s_median") else None


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with the runs of ``new`` replacing those of the same GPU, layout and staleness."""
    key = lambda e: (e.get("gpu"), e.get("layout"), e.get("staleness"))  # noqa: E731
    replaced = {key(e) for e in new}
    out = [e for e in old if key(e) not in replaced] + new
    pair_with_sync(out)
    return out


def write_results(out_dir: Path, new: list[dict[str, Any]]) -> Path:
    path = out_dir / "async_grpo.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.is_file() else []
    merged = merge(old if isinstance(old, list) else [], new)
    path.write_text(json.dumps(merged, indent=2) + "\n")
    return path


def draw_timeline(rows: list[dict[str, Any]], out_dir: Path, layout: str, k: int) -> str | None:
    """The run's last steps as a Gantt chart (``xrlhf.report.make_timeline``), copied to ``out_dir``."""
    from xrlhf.report import make_timeline

    with tempfile.TemporaryDirectory() as tmp:
        png = make_timeline(rows, Path(tmp))
        if png is None:
            return None
        name = f"async_grpo_timeline_{layout}{'' if k == 1 else '_sync' if k == 0 else f'_k{k}'}.png"
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, out_dir / name)
    return name


def run_variant(name: str, cfg, overrides: list[str], args: argparse.Namespace,
                machine: list[dict[str, Any]]) -> dict[str, Any]:
    """Run one variant with a sampler on each GPU it uses; its JSON entry."""
    import benchmarks.async_grpo as this  # the module the config names (this file may run as __main__)
    from benchmarks.common import DeviceMemorySampler, versions
    from xrlhf.report import read_metrics
    from xrlhf.runner import run

    layout, k = parse_variant(name)
    used = machine[:2 if layout == "split" else 1]
    this.BusyLoop.samplers = samplers = [DeviceMemorySampler(gpu=g["index"]) for g in used]
    run_dir = Path(tempfile.mkdtemp(prefix=f"async_grpo-{name}-"))
    t0 = time.time()
    error = None
    try:
        run(cfg, run_dir)
    except Exception as e:  # noqa: BLE001 - recorded, and the next variant still runs
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        for s in samplers:
            s.close()
        this.BusyLoop.samplers = []
    wall = round(time.time() - t0, 1)
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    entry = {"variant": name, "gpu": used[0]["name"] if used else "none",
             "gpu_total_gib": used[0]["total_gib"] if used else None, "gpus": len(used), "layout": layout,
             "staleness": k, "freshness": cfg.rollout.freshness, "workload": "W", "config": args.config,
             **summarize(rows, args.timed_from, len(used)), "wall_s": wall, "error": error,
             "timeline_png": draw_timeline(rows, Path(args.out), layout, k) if rows else None,
             "baseline_h200": BASELINE, "verify": bool(args.verify), "overrides": overrides, "run_dir": str(run_dir),
             "command": " ".join([Path(sys.executable).name, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
             "versions": versions()}
    judge(entry)
    return entry


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from benchmarks.common import MODEL_05B, ensure_model, table
    from xrlhf.config.loader import dump_config

    machine = gpus()
    if args.dry_run:
        model = str(Path(args.model or MODEL_05B).resolve())
        if not (Path(model) / "config.json").is_file():
            model = stand_in_model()
            print(f"no model at {args.model or MODEL_05B}: validated against a stand-in, {model}")
    else:
        print(f"model: {args.model or MODEL_05B} (built if missing)", flush=True)
        model = ensure_model(args.model or MODEL_05B)
    variants = args.variant_list
    if not args.dry_run:
        if not machine:
            raise SystemExit("async_grpo: no GPU found (nvidia-smi); --dry-run prints the configs on a CPU machine")
        skipped = [v for v in variants if parse_variant(v)[0] == "split" and len(machine) < 2]
        if skipped:
            print(f"skipping {', '.join(skipped)}: the split layout needs 2 GPUs, this machine has {len(machine)}",
                  flush=True)
        args.variant_list = variants = [v for v in variants if v not in skipped]
    import importlib.util

    stub = args.dry_run and importlib.util.find_spec("vllm") is None
    with as_if_installed("vllm", "generate") if stub else nullcontext():
        configs = build_configs(args, model)
    if args.dry_run:
        if stub:
            print("vllm is not installed here: validated as if it were")
        print(f"GPUs seen: {len(machine)} ({', '.join(g['name'] for g in machine) or 'none'})")
        for name, cfg, overrides in configs:
            print(f"# ---- {name}: overrides {' '.join(overrides)}\n{dump_config(cfg)}")
        return []
    entries = []
    for i, (name, cfg, overrides) in enumerate(configs, 1):
        print(f"[{time.strftime('%H:%M:%S')}] variant {i}/{len(configs)}: {name} ({args.steps} steps, timed from "
              f"{args.timed_from})", flush=True)
        entry = run_variant(name, cfg, overrides, args, machine)
        entries.append(entry)
        path = write_results(Path(args.out), entries)  # after each variant: a later crash keeps the earlier
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {entry['step_s_median']} s/step median, GPU busy "
              f"{entry['gpu_busy']}%, peak {entry['peak_gib']} GiB, {entry['wall_s']} s in all"
              + (f"; ERROR {entry['error']}" if entry["error"] else "") + f"; wrote {path}", flush=True)
    results = json.loads((Path(args.out) / "async_grpo.json").read_text())
    cols = ["step_s_median", "sync_step_s_median", "speedup", "gpu_busy", "peak_gib", "met"]
    print(table([[e["variant"], e["gpu"], *[e.get(c) for c in cols]] for e in results], ["variant", "gpu", *cols]))
    return entries


# -- episodes: the calculator env's episodes through vLLM, sync and one step off ------------------
EPISODES_OVERRIDES = ["env={name: calc, options: {min_digits: 3, max_digits: 3, eval_size: 32}}",
             "trainer.prompts_per_step=32", "trainer.samples_per_prompt=8", "algorithm.mini_batch_size=256",
             "trainer.eval_size=32", "policy.generate.max_new_tokens=48", "policy.train.lr=2.0e-5"]
EPISODES_WARMUP = ["warmup.steps=60", "warmup.batch_size=32", "warmup.lr=1.0e-4"]


def summarize_episodes(rows: list[dict[str, Any]], episodes_per_step: int) -> dict[str, Any]:
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


def episodes(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.async_grpo episodes",
                                description="Episodes on the GPU: the calculator env with vLLM, sync and one-step-off")
    p.add_argument("--mode", choices=["sync", "async"], required=True)
    p.add_argument("--from", dest="source", default=None, help="async: the sync run's directory (its warm-up)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--runs-dir", default="runs/episodes_gpu")
    args = p.parse_args(argv)

    from benchmarks.common import ROOT, ensure_model, gpu_name, run_one, write_json
    from xrlhf.report import read_metrics

    model = ensure_model()
    overrides = [*EPISODES_OVERRIDES, f"trainer.steps={args.steps}"]
    if args.mode == "sync":
        overrides += [*EPISODES_WARMUP, f"policy.model={model}"]
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
             **summarize_episodes(rows, 256), "overrides": overrides,
             "command": "python -m benchmarks.async_grpo episodes " + " ".join(argv if argv is not None else sys.argv[2:])}
    print(entry, flush=True)
    print(write_json(Path(args.out), f"episodes_gpu_{args.mode}.json", entry))
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["episodes"]:
        sys.exit(episodes(sys.argv[2:]))
    main()
