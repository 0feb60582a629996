"""Workload W: xrlhf against TRL's GRPOTrainer, measured in one call on one GPU (issue 25).

Runs TRL 1.16's GRPOTrainer on W (``benchmarks/trl_grpo.py``, from ``../shared/bench``) at one
dtype, then xrlhf's variants of ``configs/gpu/grpo_w.yaml`` back to back, each for ``--steps``
steps (10), and gives every xrlhf figure as a ratio to the TRL run of the same call. Steps
``--timed-from`` (3) .. the last are timed (medians), on both sides.

Variants (``--variants``; ``name`` or ``name=key.path=value,key.path=value``):

* ``default``: the config as shipped (our defaults: mixed precision, derived token budgets, ...);
* ``bf16``: pure bf16 weights and AdamW states (``policy.train.mixed_precision=false``);
* ``async``: ``rollout.max_staleness=1`` with vLLM awake (``sleep_level=0``) on the same GPU;
* ``sync-awake``: the synchronous loop with vLLM awake (what ``async`` is compared with);
* ``sync-split`` / ``async-split``: vLLM on a second GPU of its own (``benchmarks.async_grpo.SPLIT``,
  weights over NCCL), synchronous or one step off (issue 29; needs a machine of two GPUs);
* ``public-only``: every hook of ``xrlhf.internals`` off (``XRLHF_PUBLIC_ONLY=1``: public APIs only);
* any other name with its overrides after ``=``; ``env:NAME=value`` sets a variable for the
  variant (``off-fork=env:XRLHF_HOOKS_OFF=process.fork_server``).

Writes ``<out>/w_vs_trl.json``: one object per xrlhf run with ``gpu``, ``trl_dtype``,
``trl_step_s``, ``xrlhf_variant``, ``xrlhf_step_s``, ``ratio`` (xrlhf / TRL), ``phases``,
``gpu_busy``, ``peak_gib``, the TRL run's own figures and the command. On the GPU machine::

    python -m benchmarks.w_vs_trl --trl-dtype float32 --variants default --out $OUT
    python -m benchmarks.w_vs_trl --trl-dtype bfloat16 --variants bf16,async --out $OUT
    python -m benchmarks.w_vs_trl --trl-dtype none --variants sync-awake,async --out $OUT

TRL 1.16 supports vLLM 0.22-0.31: ``--trl-site DIR`` runs it on a stack of its own (``gpu.sh``'s
/root/site-trl: vLLM 0.25.1 on the image's torch) while xrlhf runs on its own in the same call.

W2, the second workload (another size and response length, ``configs/gpu/grpo_w2.yaml``)::

    python -m benchmarks.w_vs_trl --config configs/gpu/grpo_w2.yaml --model artifacts/model-1.5b --preset 1.5b \
        --trl-args "--prompts-per-step 32 --micro-batch 16 --max-new-tokens 480 --gpu-memory-utilization 0.4" \
        --trl-dtype float32 --variants default --steps 6 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.async_grpo import SPLIT
from xrlhf.coordinator.forkserver import environ

CONFIG = "configs/gpu/grpo_w.yaml"
VARIANTS = {
    "default": [],
    "bf16": ["policy.train.mixed_precision=false"],
    "async": ["rollout.max_staleness=1", "policy.generate.sleep_level=0"],
    "sync-awake": ["policy.generate.sleep_level=0"],
    "sync-split": list(SPLIT),
    "async-split": [*SPLIT, "rollout.max_staleness=1"],
    "public-only": ["env:XRLHF_PUBLIC_ONLY=1"],
}
"""What each named variant changes in the config."""


def parse_variants(text: str) -> list[tuple[str, list[str]]]:
    """``a,b`` (named variants) or ``a;name=k=v|k=v`` (``;`` between variants once one has overrides)."""
    out = []
    for item in [v.strip() for v in text.split(",") if v.strip()] if "=" not in text else text.split(";"):
        name, _, rest = item.partition("=")
        name = name.strip()
        if rest:
            out.append((name, [o.strip() for o in rest.split("|") if o.strip()]))
        elif name in VARIANTS:
            out.append((name, list(VARIANTS[name])))
        else:
            raise SystemExit(f"--variants: unknown variant {name!r}; valid: {', '.join(VARIANTS)} (or name=k=v|k=v)")
    return out


def median_from(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def samplers_for(used: list[dict[str, Any]], period_ms: int) -> list:
    """A ``DeviceMemorySampler`` per GPU of ``used`` (none when ``period_ms`` is 0). Both sides of a
    comparison run beside the same samplers: an ``nvidia-smi`` polling the driver is the same load
    on each, whatever it costs a host-bound step."""
    from benchmarks.common import DeviceMemorySampler

    return [DeviceMemorySampler(gpu=g["index"], period_ms=period_ms) for g in used] if period_ms > 0 else []


def run_trl(dtype: str, model: str, out: Path, steps: int, timed_from: int, timeout: float,
            extra: list[str] | None = None, processes: int = 1, site: str | None = None,
            samplers: list | None = None) -> dict[str, Any]:
    """TRL's GRPOTrainer on W in a process of its own (``processes`` > 1: ``accelerate launch``
    with TRL's ZeRO-3 recipe, one process per GPU); the median step time of the timed steps.
    ``extra``: more arguments of ``trl_grpo.py`` (another workload's shape: ``--trl-args``);
    ``site``: TRL's own stack (``common.trl_env``); ``samplers``: the GPUs sampled while it runs
    (closed here; their mean busy share over the whole run, start-up included, is ``trl_gpu_busy``)."""
    from benchmarks.common import trl_env

    bench = Path("benchmarks/trl_grpo.py")
    run_dir = out / f"trl-{dtype}"
    launch = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "benchmarks/trl_zero3.yaml",
        "--num_processes", str(processes)]
    cmd = [*launch, str(bench), "--model", model, "--out", str(run_dir), "--dtype", dtype,
           "--steps", str(steps), *(extra or [])]
    t0 = time.time()
    with open(out / f"trl-{dtype}.log", "w") as log:
        try:
            # one process: TRL's recipe is one GPU, so on a machine of several it gets the first alone
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                env=trl_env(site, processes)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    busy = [b for b in (s.utilization() for s in samplers or []) if b is not None]
    for s in samplers or []:
        s.close()
    rows = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()] \
        if (run_dir / "steps.jsonl").is_file() else []
    timed = [r["step_s"] for r in rows if r["step"] >= timed_from]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    return {"trl_dtype": dtype, "trl_step_s": median_from(timed), "trl_steps": len(rows), "trl_rc": rc,
            "trl_wall_s": round(time.time() - t0, 1), "trl_init_s": summary.get("init_s"),
            "trl_peak_gib": max((r.get("torch_max_reserved_gb", 0.0) for r in rows), default=None),
            "trl_versions": {k: summary.get(k) for k in ("trl", "torch", "vllm")}, "trl_args": extra or [],
            "trl_processes": processes, "trl_site": site,
            "trl_gpu_busy": round(sum(busy) / len(busy), 1) if busy else None}


def run_xrlhf(name: str, overrides: list[str], model: str, args: argparse.Namespace,
              machine: list[dict[str, Any]]) -> dict[str, Any]:
    """One xrlhf variant of W in this process, with the GPU sampled every ``args.sample_ms``
    (``async_grpo.BusyGRPO``; 0: not sampled); an override ``env:NAME=value`` is set in the
    environment for that variant (``env:XRLHF_PUBLIC_ONLY=1``)."""
    env = dict(o[4:].split("=", 1) for o in overrides if o.startswith("env:"))
    overrides = [o for o in overrides if not o.startswith("env:")]
    all_overrides = [f"policy.model={model}", f"trainer.steps={args.steps}", "trainer.eval_every=0",
                     f"trainer.eval_size={args.eval_size}", "trainer.save_final=false",
                     "algorithm.name=benchmarks.async_grpo:BusyGRPO", "algorithm.advantage_estimator=grpo",
                     "policy.weight_sync.verify=false", "checkpoint.every=0", "checkpoint.every_minutes=0",
                     *overrides]  # checkpoints off: W's last one is ~6 GB, W7's ~100 GB, and none is timed
    with environ(env):
        return _run_xrlhf(name, overrides, env, model, args, machine, all_overrides)


def _run_xrlhf(name: str, overrides: list[str], env: dict[str, str], model: str, args: argparse.Namespace,
               machine: list[dict[str, Any]], all_overrides: list[str]) -> dict[str, Any]:
    import tempfile
    import traceback

    import benchmarks.async_grpo as ag
    from xrlhf.report import read_metrics
    from xrlhf.runner import run
    from xrlhf.validation import load_config

    cfg = load_config(Path(args.config), all_overrides)
    used = machine[:cfg.ray.num_gpus or 1]  # every GPU the run may use is sampled and counted
    ag.BusyLoop.samplers = samplers = samplers_for(used, args.sample_ms)
    run_dir = Path(tempfile.mkdtemp(prefix=f"w_vs_trl-{name}-"))
    t0, error = time.time(), None
    try:
        run(cfg, run_dir)
    except Exception as e:  # noqa: BLE001 - recorded; the next variant still runs
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        for s in samplers:
            s.close()
        ag.BusyLoop.samplers = []
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    keep = Path(args.out) / f"xrlhf-{name}"  # the run's own log and metrics beside the figures
    keep.mkdir(parents=True, exist_ok=True)
    for f in ("train.log", "metrics.jsonl", "report.md", "summary.json"):
        if (run_dir / f).is_file():
            shutil.copy(run_dir / f, keep / f)
    if (run_dir / "plots").is_dir():
        shutil.copytree(run_dir / "plots", keep / "plots", dirs_exist_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a stopped run's: a 7B model's is ~100 GB
    s = ag.summarize(rows, args.timed_from, len(used))
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else ""
    ready = [ln for ln in log.splitlines() if "Ray handles ready in" in ln]
    return {"xrlhf_variant": name, "overrides": overrides, "env": env, "xrlhf_step_s": s["step_s_median"],
            "phases": s["phases_median"], "gpu_busy": s["gpu_busy"], "peak_gib": s["peak_gib"],
            "staleness": s["staleness_observed"], "reward_mean_last": s["reward_mean_last"],
            "mismatch_mean": s["mismatch_mean"], "tokens_per_s_per_gpu": s["tokens_per_s_per_gpu"],
            "train_mfu": s["train_mfu"], "per_step": s["per_step"], "ready_line": ready[-1] if ready else None,
            "xrlhf_wall_s": round(time.time() - t0, 1), "error": error, "run_dir": str(run_dir), "gpus_used": len(used)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trl-dtype", default="float32", choices=["float32", "bfloat16", "none"])
    p.add_argument("--variants", default="default")
    p.add_argument("--model", default="artifacts/model-0.5b")
    p.add_argument("--preset", default="0.5b", help="the model preset --model is built from when missing")
    p.add_argument("--config", default=CONFIG, help="xrlhf's config (W2: configs/gpu/grpo_w2.yaml)")
    p.add_argument("--trl-args", default="", help="more arguments of TRL's script, one string (W2's shape)")
    p.add_argument("--trl-processes", type=int, default=1, help="GPUs for TRL: > 1 runs its ZeRO-3 recipe "
                   "under accelerate launch (benchmarks/trl_zero3.yaml)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timed-from", type=int, default=3)
    p.add_argument("--eval-size", type=int, default=16)
    p.add_argument("--trl-timeout", type=float, default=330)
    p.add_argument("--trl-site", default=None, help="TRL's own stack, a `pip --target` folder put first on its "
                   "PYTHONPATH instead of xrlhf's (TRL on a vLLM it supports: benchmarks/gpu.sh's /root/site-trl)")
    p.add_argument("--sample-ms", type=int, default=50, help="nvidia-smi samples each GPU used this often, beside "
                   "TRL and xrlhf alike (the busy share); 0: no sampling on either side")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.async_grpo import gpus
    from benchmarks.common import ensure_model, host_label, versions

    machine, host = gpus(), host_label()
    model = ensure_model(args.model, preset=args.preset)
    trl = run_trl(args.trl_dtype, model, out, args.steps, args.timed_from, args.trl_timeout, args.trl_args.split(),
                  args.trl_processes, args.trl_site, samplers_for(machine[:args.trl_processes], args.sample_ms)) \
        if args.trl_dtype != "none" else {"trl_dtype": None, "trl_step_s": None}
    print(f"[w_vs_trl] TRL {args.trl_dtype}: {trl.get('trl_step_s')} s/step", flush=True)
    entries = []
    for name, overrides in parse_variants(args.variants):
        x = run_xrlhf(name, overrides, model, args, machine)
        ratio = round(x["xrlhf_step_s"] / trl["trl_step_s"], 3) if x["xrlhf_step_s"] and trl.get("trl_step_s") else None
        entry = {"gpu": machine[0]["name"] if machine else "none", "config": args.config, **trl, **x, "ratio": ratio,
                 "host": host, "sample_ms": args.sample_ms,
                 "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.w_vs_trl", *sys.argv[1:]]),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "versions": versions()}
        entries.append(entry)
        print(f"[w_vs_trl] {name}: {x['xrlhf_step_s']} s/step, ratio {ratio}, phases {x['phases']}, "
              f"busy {x['gpu_busy']}", flush=True)
        path = out / "w_vs_trl.json"
        old = json.loads(path.read_text()) if path.is_file() else []
        path.write_text(json.dumps(old + [entry], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
