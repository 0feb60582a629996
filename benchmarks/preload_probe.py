"""Where vLLM's import goes slow in a Ray actor (issue 25's warm start-up).

In W's start the generator's actor imports vLLM in 12-15 s; a plain process takes ~4.7 s. This
probe times the same import (``VLLMGenerateEngine.preload`` with W's options) in fresh processes:

* ``plain``: a subprocess, nothing else running;
* ``actor``: a Ray actor, the import in the call itself (the actor's executor thread);
* ``actor-thread``: a Ray actor, the import in a thread the call starts (how ``EngineHost.preload``
  imports), the call returning at once;
* ``actor-thread-busy``: as ``actor-thread``, while two other actors import torch, transformers
  and the HF engines (what the policy's and the reference's workers do meanwhile).

Each mode runs ``--rounds`` times, interleaved; a fresh actor (process) each time. Writes
``preload_probe.json``. On the GPU machine (vLLM installed)::

    python -m benchmarks.preload_probe --rounds 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import gpu_name, write_json
from benchmarks.startup import W_VLLM

PLAIN = ("import time; t = time.perf_counter(); from benchmarks.preload_probe import _profiled; "
         "_profiled({what!r}, {profile!r}); print(time.perf_counter() - t)")


def _profiled(what: str, path: str | None) -> None:
    """``_preload(what)``, under cProfile when ``path`` is given: its top functions by cumulative
    and by own time written there."""
    if not path:
        return _preload(what)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(_preload, what)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(70)
    stats.sort_stats("tottime").print_stats(50)
    Path(path).write_text(text.getvalue())


def _preload(what: str) -> None:
    if what == "transformers":  # the probe's own test on a machine without vLLM
        import transformers  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401
        return
    from xrlhf.engines.vllm import VLLMGenerateEngine

    VLLMGenerateEngine.preload(dict(W_VLLM))


class Importer:
    """A fresh process that imports on request and says how long it took."""

    def __init__(self, what: str, profile: str | None = None) -> None:
        self.what, self.profile = what, profile
        self.seconds: float | None = None
        self.thread: threading.Thread | None = None

    def now(self) -> float:
        t = time.perf_counter()
        _profiled(self.what, self.profile)
        return time.perf_counter() - t

    def start_thread(self) -> None:
        def run() -> None:
            t = time.perf_counter()
            _preload(self.what)
            self.seconds = time.perf_counter() - t

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def joined(self) -> float:
        self.thread.join()
        return self.seconds

    def hf(self) -> float:
        t = time.perf_counter()
        import transformers  # noqa: F401

        import xrlhf.engines.hf.infer  # noqa: F401
        import xrlhf.engines.hf.train  # noqa: F401
        return time.perf_counter() - t


def one(mode: str, what: str, profile: str | None = None) -> float:
    """Seconds of one import in mode ``mode``; ``profile``: a directory for cProfile's tables
    (``plain`` and ``actor``)."""
    where = str(Path(profile).resolve() / f"profile-{mode}.txt") if profile else None
    if mode == "plain":
        code = PLAIN.format(what=what, profile=where)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    import ray

    actor = ray.remote(num_cpus=0)(Importer)
    a = actor.remote(what, where if mode == "actor" else None)
    ray.get(a.__ray_ready__.remote())
    others = [actor.remote(what) for _ in range(2)] if mode.endswith("busy") else []
    for o in others:
        ray.get(o.__ray_ready__.remote())
    if mode == "actor":
        seconds = ray.get(a.now.remote())
    else:
        busy = [o.hf.remote() for o in others]
        ray.get(a.start_thread.remote())
        seconds = ray.get(a.joined.remote())
        ray.get(busy)
    for x in [a, *others]:
        ray.kill(x)
    return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="plain,actor,actor-thread,actor-thread-busy")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", default=None, help="a directory: cProfile's tables of the plain and actor imports")
    ap.add_argument("--what", default="vllm", choices=["vllm", "transformers"], help="transformers: a machine without vLLM")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from types import SimpleNamespace

    from xrlhf.coordinator.coordinator import init_ray, shutdown_ray

    init_ray(SimpleNamespace(address=None, num_cpus=None, num_gpus=None, log_to_driver=False, mps=False))
    results: dict[str, list[float]] = {m: [] for m in args.modes.split(",")}
    try:
        for r in range(args.rounds):
            for mode in results:
                results[mode].append(round(one(mode, args.what, args.profile), 2))
                print(f"round {r + 1} {mode}: {results[mode][-1]} s", flush=True)
    finally:
        shutdown_ray()
    out = {"gpu": gpu_name(), "what": args.what, "options": W_VLLM, "import_s": results, "cpus": os.cpu_count()}
    write_json(args.out, "preload_probe.json", out)
    return out


if __name__ == "__main__":
    main()
