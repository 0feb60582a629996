"""Start-up of workload W's handles on one GPU, cold and warm, and what a W step costs in memory.

Runs ``xrlhf run configs/gpu/grpo_w.yaml`` (``trainer.steps`` small) once per variant, each in
a process of its own, and reads from its log and its metrics:

* ``ready_s``: "Ray handles ready in X s" (Ray, placement, every worker's engines, the weight
  sync wired); ``first_step_s``: from the command's start to the first step's metrics row;
* ``vllm``: vLLM's own lines: engine init (profile, KV cache, warm-up), of which compilation,
  graph capture; ``engine_process_s``: from vLLM's arguments to its engine process running;
* for the last variant: each step's phase times and the memory timeline (``memory/<phase>/...``,
  ``logging.memory_timeline``), whose largest ``device_gib`` is the step's device peak.

Variants (``--variants``, in order; caches are directories of their own, so "cold" is cold):

* ``cold``: empty vLLM/Inductor/Triton caches (a fresh machine's first run), W as shipped;
* ``warm``: the same caches again (what a second run on the machine sees);
* ``warm-compile`` / ``cold-compile``: vLLM with torch.compile (``policy.generate.torch_compile=true``,
  vLLM's default; off in xrlhf since 2026-11-26), ``-nocompile``: without it (the run of that day
  when it was still on);
* ``warm-multiprocess``: vLLM's engine core in a process of its own (the default before issue 25);
* ``warm-eager``: the trainer's and the reference's layers not compiled; ``warm-threads1``:
  Inductor's compile pool of one thread (no worker processes); ``warm-importtime``:
  ``PYTHONPROFILEIMPORTTIME=1`` in every process (why ``import vllm`` takes 12.9 s in the
  generator's actor and 4.7 s in a process alone); ``warm-fullhead``: Ray's whole head (``ENV``);
  ``warm-preload``: vLLM imported by every Ray worker before it takes work (``ENV``);
  ``warm-profile``: each worker's engine builds and ``preload`` imports under cProfile, their
  tables in ``profile-<variant>/`` (``common.worker_diagnostics``); ``warm-fewgraphs``: vLLM
  captures 11 decode batch sizes as CUDA graphs instead of 51 (2.0 s of capture warm);
  ``warm-noprestart``: Ray prestarts no idle workers (``ENV``).

A name starting with ``cold`` empties the caches first.

(The order "vLLM's handle whole and alone first", 102 s against 89 s on an H100, is in
startup.json's history; the switch that ran it left the production code.)

Writes ``startup.json``. On the GPU machine::

    python -m benchmarks.startup --out benchmarks/results

**The vLLM engine alone** (``--engine``, issue 25): ``VLLMGenerateEngine`` built in a fresh
process per variant, all variants sharing one compile cache (``--cache-dir``, the engine's
``compile_cache_dir``), so "cold" (the directory emptied first) and the variants after it
(warm) differ only by the cache. Each reports the seconds to import vLLM (``preload``) and to
build the engine, and vLLM's own lines (engine process start, model load, compilation, graph
capture, KV cache); with ``--generate N`` the variants of ``--generate-for`` then time one
generation of N prompts with and without logprobs. Variants (``ENGINE_VARIANTS``) over W's vLLM
options with the KV cache sized for W's batch (``W_VLLM``): ``cold``, ``warm``, ``warm-inprocess``
(the engine core in this process: no process to spawn), ``nocompile-inprocess`` (no torch.compile,
whole-step CUDA graphs for decoding; its compile key differs but it compiles nothing), ``fewgraphs`` (11 CUDA-graph sizes
instead of 51; the sizes are part of vLLM's compile cache key, so its first run compiles: run it
twice). A configuration's compile cache is found only by a configuration of the same key
(``VllmConfig.compute_hash``: the KV cache's size is in it, the multiprocessing switch and
prefix caching are not)::

    python -m benchmarks.startup --engine --variants cold,warm,warm-inprocess --generate 512 \
        --generate-for warm-inprocess --cache-dir /tmp/xrlhf-i25-cache --out benchmarks/results

writes ``startup-engine.json``. ``--parse-log FILE`` prints vLLM's start-up lines of any log as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import diagnostics_env, gpu_name, write_json

CONFIG = "configs/gpu/grpo_w.yaml"
VARIANTS = ("cold", "warm", "warm-compile", "cold-compile", "warm-nocompile", "cold-nocompile", "warm-multiprocess",
            "warm-eager", "warm-importtime", "warm-threads1", "warm-fullhead", "warm-preload", "warm-profile",
            "warm-fewgraphs", "warm-noprestart", "warm-nofork", "warm-prev")
FLAGS = {"compile": ["policy.generate.torch_compile=true"], "nocompile": ["policy.generate.torch_compile=false"],
         "multiprocess": ["policy.generate.multiprocessing=true"],
         "eager": ["policy.train.compile=false", "reference.infer.compile=false"],
         "fewgraphs": ["policy.generate.cudagraph_capture_sizes=[1,2,4,8,16,32,64,128,256,384,512]"],
         "nofork": ["ray.fork_server=false"]}
"""What a variant's words after cold/warm override (``fewgraphs``: 11 decode CUDA graphs, not 51;
``nofork``: the generator's worker starts the usual way, not from the fork server)."""
PREV_TREE = "XRLHF_PREV_TREE"
"""Where the ``prev`` variant's build is: a directory holding its ``xrlhf`` and ``configs``."""
ENV = {"importtime": {"PYTHONPROFILEIMPORTTIME": "1", "RAY_DEDUP_LOGS": "0"}, "threads1": {"TORCHINDUCTOR_COMPILE_THREADS": "1"},
       "fullhead": {"XRLHF_HOOKS_OFF": "ray.lean_head"}, "preload": {"RAY_preload_python_modules": "vllm"},
       "noprestart": {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}}
"""What a variant's words set in the run's environment (a local Ray's workers inherit it):
``importtime``: every process's imports, module by module, on its stderr (the run's log);
``fullhead``: Ray's whole head (the dashboard's API server and the autoscaler's monitor too, as
before ``internals.ray.lean_head``); ``preload``: every Ray worker imports vLLM before it takes work
(Ray's ``preload_python_modules``; the workers Ray prestarts when the driver connects begin then);
``noprestart``: Ray starts no idle workers when the driver connects (it starts one per CPU, 16 on
the GPU machine, that import Ray beside the run's own workers; a run's workers are actors only).
``prev``: the previous build, a tree of its files named by ``PREV_TREE`` (the same call's baseline:
``git archive COMMIT | tar x -C .prev`` makes it, the commit in ``.prev/COMMIT``).
(2026-11-27, eighth session, also ran ``warm-precall``: vLLM's import begun in the generator's
first call, as before, not in its constructor: 19.7 and 19.7 s against 16.0 and 19.0 s; the
switch left the code.)
(2026-11-27 also ran ``warm-mainpreload``, the worker's ``preload`` importing in the call rather than
in a thread: 27.8 s against 27.8 and 28.0 s; the switch left the code.)"""

_VLLM = {
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "compile_s": r"init engine .* \(compilation: ([\d.]+) s\)",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "model_load_s": r"Model loading took [\d.]+ GiB and ([\d.]+) seconds",
}
_STAMP = r"(\d\d:\d\d:\d\d)"


def _seconds(hms: str) -> int:
    h, m, s = (int(x) for x in hms.split(":"))
    return h * 3600 + m * 60 + s


W_VLLM = {"sleep_level": 2, "gpu_memory_utilization": 0.3, "max_model_len": 512, "max_num_seqs": 512,
          "dtype": "bfloat16", "kv_cache_tokens": "batch"}
"""The vLLM options of configs/gpu/grpo_w.yaml, the KV cache sized for its batch (512 x 512 tokens)."""

FEW_GRAPHS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512]

ENGINE_VARIANTS = {"cold": (True, {}), "warm": (False, {}), "warm-inprocess": (False, {"multiprocessing": False}),
                   "nocompile-inprocess": (False, {"torch_compile": False, "multiprocessing": False}),
                   "compile-inprocess": (False, {"torch_compile": True, "multiprocessing": False}),
                   "fewgraphs": (False, {"cudagraph_capture_sizes": FEW_GRAPHS}),
                   "fewgraphs-inprocess": (False, {"cudagraph_capture_sizes": FEW_GRAPHS, "multiprocessing": False})}
"""name -> (empty the cache first, options over ``W_VLLM``)."""


def parse_log(text: str) -> dict[str, Any]:
    """The start-up figures of one run's log (``None`` where a line is missing)."""
    out: dict[str, Any] = {}
    m = re.search(r"Ray handles ready in ([\d.]+)s", text)
    out["ready_s"] = float(m.group(1)) if m else None
    vllm: dict[str, Any] = {}
    for key, pattern in _VLLM.items():
        m = re.search(pattern, text)
        vllm[key] = float(m.group(1)) if m else None
    args = re.search(_STAMP + r" \[api_utils.py:\d+\] non-default args", text)
    core = re.search(_STAMP + r" \[core.py:\d+\] Initializing a V1 LLM engine", text)
    vllm["engine_process_s"] = _seconds(core.group(1)) - _seconds(args.group(1)) if args and core else None
    out["vllm"] = vllm
    return out


def _rows(run_dir: Path) -> list[dict]:
    """The run's metrics rows so far (none before its first)."""
    from xrlhf.report import read_metrics

    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []


def cache_env(work: Path) -> dict[str, str]:
    """This process's environment with vLLM's, Inductor's and Triton's caches in ``work/caches``
    (one set for every variant)."""
    caches = work / "caches"
    return dict(os.environ, VLLM_CACHE_ROOT=str(caches / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                TRITON_CACHE_DIR=str(caches / "triton"))


def run_variant(name: str, work: Path, steps: int, model: str, timeout: float) -> dict[str, Any]:
    """One ``xrlhf run`` of W for variant ``name``; its figures."""
    caches = work / "caches"  # one set for all variants: "cold" empties it
    if name.startswith("cold") and caches.exists():
        shutil.rmtree(caches)
    env = cache_env(work)
    overrides = [f"trainer.steps={steps}", f"policy.model={model}", "logging.tensorboard=false"]
    overrides += [o for word in name.split("-")[1:] for o in FLAGS.get(word, [])]
    for word in name.split("-")[1:]:
        env.update(ENV.get(word, {}))
    if "profile" in name.split("-")[1:]:  # each worker's engine builds and imports under cProfile
        env.update(diagnostics_env(profile_dir=str(work / f"profile-{name}")))
    run_dir = work / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cwd = None
    if "prev" in name.split("-")[1:]:  # the previous build runs from its own tree, first on the path
        cwd = os.path.abspath(os.environ[PREV_TREE])
        here = os.path.abspath(".")
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != here]
        env["PYTHONPATH"] = os.pathsep.join([cwd, *rest])
        overrides = [o if not o.startswith("policy.model=") else f"policy.model={os.path.abspath(model)}"
                     for o in overrides]
    cmd = [sys.executable, "-m", "xrlhf.cli", "run", CONFIG, *overrides, "--output-dir", str(run_dir.absolute())]
    t0 = time.time()
    first = None
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        while proc.poll() is None and time.time() - t0 < timeout:
            if first is None and any("time/step_s" in r for r in _rows(run_dir)):
                first = time.time() - t0
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
    wall = time.time() - t0
    text = (work / f"{name}.log").read_text(errors="replace")
    out = {"variant": name, "exit": proc.returncode, "wall_s": round(wall, 1),
           "first_step_s": None if first is None else round(first, 1), **parse_log(text)}
    if (run_dir / "summary.json").is_file():  # the coordinator's timeline: each handle up, built; ready
        out["timeline"] = json.loads((run_dir / "summary.json").read_text()).get("startup")
    rows = [r for r in _rows(run_dir) if "time/step_s" in r]
    out["steps"] = [{k: v for k, v in r.items() if k.startswith(("time/", "memory/"))} for r in rows]
    device = [v for r in rows for k, v in r.items() if k.startswith("memory/") and k.endswith("/device_gib")]
    out["step_peak_gib"] = max(device) if device else None
    if proc.returncode != 0:
        out["log_tail"] = text[-2000:]
    return out


def engine_worker(args) -> None:
    """One engine start in this (fresh) process; its figures to ``args.result`` as JSON."""
    t0 = time.perf_counter()
    from benchmarks.common import ensure_model, vllm_options
    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.vllm import VLLMGenerateEngine

    model = ensure_model(args.model)
    options = vllm_options(**json.loads(args.options))
    out: dict[str, Any] = {"options": {k: options[k] for k in json.loads(args.options)}}
    t1 = time.perf_counter()
    VLLMGenerateEngine.preload(options)
    out["import_s"] = round(time.perf_counter() - t1, 2)
    t1 = time.perf_counter()
    engine = VLLMGenerateEngine(EngineSpec(model, device="cuda", options=options))
    out["engine_s"] = round(time.perf_counter() - t1, 2)
    out["total_s"] = round(time.perf_counter() - t0, 2)  # from this process's first line (Python and torch aside)
    Path(args.result).write_text(json.dumps(out))
    if args.generate:
        from benchmarks.generation import prompts_for, timed

        prompts = prompts_for(model, args.generate, 8)
        for name, logprobs in (("generate_logprobs", True), ("generate_no_logprobs", False)):
            seconds, tokens = timed(engine, prompts, args.new_tokens, logprobs=logprobs, warm_up=name == "generate_logprobs")
            out[name] = {"seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds)}
            Path(args.result).write_text(json.dumps(out))
    engine.shutdown()


def run_engine_variant(name: str, args) -> dict[str, Any]:
    """``engine_worker`` in a fresh process for variant ``name``; its figures and vLLM's lines."""
    cold, over = ENGINE_VARIANTS[name]
    cache = Path(args.cache_dir)
    if cold and cache.exists():
        shutil.rmtree(cache)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result, log_path = work / f"engine-{name}.json", work / f"engine-{name}.log"
    result.unlink(missing_ok=True)
    options = {**W_VLLM, **over, "compile_cache_dir": str(cache)}
    generate = args.generate if name in args.generate_for.split(",") else 0
    cmd = [sys.executable, "-m", "benchmarks.startup", "--engine-worker", "--options", json.dumps(options),
           "--result", str(result), "--model", args.model, "--generate", str(generate),
           "--new-tokens", str(args.new_tokens)]
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    out = {"variant": name, "cold": cold, "exit": proc.returncode, "wall_s": round(time.time() - t0, 1),
           **(json.loads(result.read_text()) if result.is_file() else {}), "vllm": parse_log(text)["vllm"]}
    if proc.returncode != 0:
        out["log_tail"] = text[-2000:]
    return out


def engine_main(args) -> dict[str, Any]:
    names = [v for v in args.variants.split(",") if v]
    unknown = set(names) - set(ENGINE_VARIANTS)
    if unknown:
        sys.exit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(ENGINE_VARIANTS)}")
    results = []
    for name in names:
        r = run_engine_variant(name, args)
        print(f"{name}: exit {r['exit']}, import {r.get('import_s')} s, engine {r.get('engine_s')} s, "
              f"vLLM {r['vllm']}", flush=True)
        results.append(r)
        data = {"gpu": gpu_name(), "vllm_options": W_VLLM, "targets": {"cold_ready_s": 45, "warm_ready_s": 15},
                "variants": results}
        write_json(args.out, "startup-engine.json", data)
    return data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--work", default="/tmp/xrlhf-startup")
    ap.add_argument("--variants", default=None, help=f"default: {','.join(VARIANTS)}; with --engine: "
                    f"{','.join(ENGINE_VARIANTS)}")
    ap.add_argument("--steps", type=int, default=2, help="W steps per run (the last variant: --last-steps)")
    ap.add_argument("--last-steps", type=int, default=4, help="steps of the last variant (memory timeline)")
    ap.add_argument("--model", default="artifacts/model-0.5b")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--engine", action="store_true", help="time the vLLM engine alone (the module docstring)")
    ap.add_argument("--cache-dir", default="/tmp/xrlhf-startup/cache", help="--engine: the shared compile cache")
    ap.add_argument("--generate", type=int, default=0, help="--engine: then generate this many prompts, timed")
    ap.add_argument("--generate-for", default="", help="--engine: the variants that generate (comma-separated)")
    ap.add_argument("--parse-log", default=None, help="print vLLM's start-up lines of this log as JSON, and stop")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.parse_log:
        print(json.dumps(parse_log(Path(args.parse_log).read_text(errors="replace"))))
        return {}
    if args.engine_worker:
        return engine_worker(args)
    if args.engine:
        args.variants = args.variants or "cold,warm,warm-inprocess"
        return engine_main(args)
    args.variants = args.variants or ",".join(VARIANTS)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    names = [v for v in args.variants.split(",") if v]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    results = []
    for i, name in enumerate(names):
        steps = args.last_steps if i == len(names) - 1 else args.steps
        r = run_variant(name, work, steps, args.model, args.timeout)
        print(f"{name}: exit {r['exit']}, ready {r['ready_s']} s, first step {r['first_step_s']} s, "
              f"vLLM {r['vllm']}, step peak {r['step_peak_gib']} GiB", flush=True)
        results.append(r)
        data = {"gpu": gpu_name(), "config": CONFIG, "command": "python -m benchmarks.startup",
                "targets": {"cold_ready_s": 45, "warm_ready_s": 15}, "variants": results}
        write_json(args.out, "startup.json", data)  # after each variant: a cut-off run keeps what it measured
    return data


if __name__ == "__main__":
    main()
