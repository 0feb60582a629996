"""The floor of W's warm start on one GPU: its critical path in parts that xrlhf does not own,
each timed alone in fresh processes of one call (issue 25's 15 s target).

W's handles are ready when its generator is (the coordinator's timeline: the trainers are built
3-4 s before it). The generator's path: Ray starts and hands the generator's actor a worker
process; that process imports torch, transformers and vLLM; vLLM builds W's engine. The probes
time those parts with nothing of xrlhf's coordination between them:

* ``ray``: a fresh driver starts Ray as a run does (``coordinator.init_ray``: the lean head, one
  idle worker prestarted per CPU) and creates one actor: ``ray_s`` when ``init_ray`` returned,
  ``actor_s`` when the actor's process began importing its class (this module: nothing heavy),
  ``up_s`` when its first call returned; seconds from just before ``init_ray``, W's ``t0``.
* ``generator``: a fresh process does what the generator's actor does, without Ray: imports the
  worker's class (``EngineWorker``: torch, Ray, the engines' host), constructs it with W's engine
  spec to preload (made by the parent from W's config and topology, as the driver makes it; the
  constructor's lean imports, then vLLM's import in a thread), then ``setup`` builds W's generate
  engine once that import is done; with ``benchmarks.startup``'s warm caches. Each part's
  seconds, ``setup``'s own (vLLM's import, the build), and ``total_s`` from the process's birth.

(2026-11-27, eighth session: the probe's first two versions imported the packages themselves,
the first with the driver's config and topology, the second without the worker's lean imports:
14.2-14.9 s from the process's birth, more than W's actor took, so neither was a floor. The
first also made CUDA's context in a second thread while vLLM imported: vLLM's import 4.9-5.0 s
against 3.7-3.8 s, the build 3.9 s against 3.3 s; no overlap to be had, dropped.)

``floor_s`` = median ``actor_s`` + median generator ``total_s``: what a generator started as a Ray
actor after Ray, as xrlhf's is, takes on this machine with nothing beside it (W's trainers build
meanwhile; the probes leave them out). ``--warm N`` then times W's warm
start N times (``benchmarks.startup``'s ``warm``) in the same call, for what xrlhf adds. Run
``benchmarks.startup --variants cold`` first (the caches). Writes ``startfloor.json``::

    python -m benchmarks.startfloor --rounds 2 --warm 2 --out $OUT/startfloor
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODULE_AT = time.time()
"""When this module began to be imported: in the ``ray`` probe's actor, when its class came."""

CONFIG = "configs/gpu/grpo_w.yaml"


class Probe:
    """The ``ray`` probe's actor: it only says when its module came and when it was made."""

    def __init__(self):
        self.init_at = time.time()

    def times(self) -> dict[str, float]:
        return {"module_at": MODULE_AT, "init_at": self.init_at}


def ray_probe() -> dict[str, Any]:
    """Start Ray as ``xrlhf run`` does, one actor up; seconds from just before ``init_ray``."""
    import ray

    from xrlhf.config.schema import RayConfig
    from xrlhf.coordinator.coordinator import init_ray, shutdown_ray

    t0 = time.time()
    init_ray(RayConfig(num_gpus=1))
    ray_s = time.time() - t0
    # by reference (this file runs as __main__ here, whose classes Ray would pickle by value): the
    # actor's process imports this module, and its MODULE_AT is that process's
    from benchmarks.startfloor import Probe as ByName

    actor = ray.remote(num_cpus=1)(ByName).remote()
    times = ray.get(actor.times.remote(), timeout=120)
    out = {"ray_s": ray_s, "actor_s": times["module_at"] - t0, "up_s": time.time() - t0}
    shutdown_ray()
    return {k: round(v, 2) for k, v in out.items()}


def generator_probe(spec_path: str) -> dict[str, Any]:
    """W's generate engine built in this fresh process by the generator's own worker class, outside
    Ray: the class imported (torch, Ray, the engines' host), constructed with the engines to
    preload (its lean imports, then vLLM's import in a thread), ``setup`` (which waits for that
    import, then builds). Each part's seconds, and ``total_s`` from the process's birth."""
    from xrlhf.utils.timeline import process_start

    born, t = process_start(), time.time()
    out: dict[str, Any] = {"python_s": t - born if born else None}

    def lap(name: str) -> None:
        nonlocal t
        now = time.time()
        out[name] = now - t
        t = now

    from xrlhf.coordinator.worker import EngineWorker

    lap("class_s")
    import pickle

    engines = {"generate": pickle.loads(Path(spec_path).read_bytes())}
    worker = EngineWorker("rollout", 0, 1, preload=engines)
    lap("init_s")
    from xrlhf.engines.base import DistInfo

    done = worker.setup(engines, DistInfo())
    lap("setup_s")
    out.update({f"setup/{k}": v for k, v in done["seconds"].items()})  # imports_s (vLLM's), generate_s (the build)
    out["total_s"] = time.time() - born if born else None
    worker.gen.shutdown()
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def write_spec(path: Path, config: str = CONFIG, overrides: list[str] | None = None) -> None:
    """The generate engine (name, spec) of ``config`` (W) with ``overrides`` as its topology gives
    it to the actor, pickled to ``path``."""
    import pickle

    from xrlhf.topology import topology
    from xrlhf.validation import load_config

    cfg = load_config(config, overrides or [])
    plan = topology(cfg, cfg.policy.model)
    path.write_bytes(pickle.dumps(next(s for s in plan.handles if "generate" in s.engines).engines["generate"]))


def _probe(kind: str, work: Path, timeout: float) -> dict[str, Any]:
    """``kind`` (ray / generator) in a fresh process; its figures."""
    from benchmarks.startup import cache_env

    result = work / f"floor-{kind}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.startfloor", "--probe", kind, "--result", str(result),
           "--spec", str(work / "gen-spec.pkl")]
    with open(work / f"floor-{kind}.log", "a") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=cache_env(work), timeout=timeout)
    if proc.returncode != 0 or not result.is_file():
        return {"exit": proc.returncode, "log": str(work / f"floor-{kind}.log")}
    return json.loads(result.read_text())


def summarize(rounds: dict[str, list[dict[str, Any]]], warm: list[float | None]) -> dict[str, Any]:
    """The medians of each probe's figures and ``floor_s`` (median ``actor_s`` + median generator
    ``total_s``); ``warm_ready_s`` and, where both exist, ``above_floor_s``: what W's warm start
    takes beyond the floor."""
    med = {kind: {k: round(statistics.median(r[k] for r in rs if r.get(k) is not None), 2)
                  for k in rs[0] if all(isinstance(r.get(k), (int, float)) for r in rs)}
           for kind, rs in rounds.items() if rs}
    out: dict[str, Any] = {"median": med}
    ray_s, gen = med.get("ray", {}).get("actor_s"), med.get("generator", {}).get("total_s")
    if ray_s is not None and gen is not None:
        out["floor_s"] = round(ray_s + gen, 2)
    ready = [w for w in warm if w is not None]
    if ready:
        out["warm_ready_s"] = ready
        if "floor_s" in out:
            out["above_floor_s"] = round(statistics.median(ready) - out["floor_s"], 2)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--work", default="/tmp/xrlhf-startup", help="benchmarks.startup's folder (its warm caches)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default="ray,generator")
    ap.add_argument("--config", default=CONFIG, help="the run whose generator is probed (W)")
    ap.add_argument("--warm", type=int, default=0, help="then W's warm start this many times (benchmarks.startup)")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        out = ray_probe() if args.probe == "ray" else generator_probe(args.spec)
        Path(args.result).write_text(json.dumps(out))
        return out
    from benchmarks.common import gpu_name, versions, write_json
    from benchmarks.startup import run_variant

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in args.kinds.split(",") if k]
    if "generator" in kinds:
        write_spec(work / "gen-spec.pkl", args.config)
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    warm: list[dict[str, Any]] = []
    for i in range(args.rounds):  # interleaved: a machine's drift spreads over every kind alike
        for kind in kinds:
            r = _probe(kind, work, args.timeout)
            print(f"round {i + 1} {kind}: {r}", flush=True)
            rounds[kind].append(r)
    for i in range(args.warm):
        r = run_variant("warm", work, 1, "artifacts/model-0.5b", args.timeout)
        print(f"W warm {i + 1}: ready {r['ready_s']} s, timeline {r.get('timeline')}", flush=True)
        warm.append({k: r.get(k) for k in ("exit", "ready_s", "timeline", "vllm")})
    ok = {k: [r for r in rs if "exit" not in r] for k, rs in rounds.items()}
    data = {"gpu": gpu_name(), "command": "python -m benchmarks.startfloor " + " ".join(argv or sys.argv[1:]),
            "versions": versions(), "cpus": os.cpu_count(), "rounds": rounds, "warm": warm,
            **summarize(ok, [w["ready_s"] for w in warm])}
    write_json(args.out, "startfloor.json", data)
    print(json.dumps({k: data[k] for k in data if k not in ("rounds", "warm")}, indent=1))
    return data


if __name__ == "__main__":
    main()
