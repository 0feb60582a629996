"""The ``cpu`` transport's host-side path, before and after its flat-buffer packing, on a CPU.

One sync of ``--gib`` GiB of float32 weights (tensor sizes of a 0.5B Qwen-like model, repeated)
through what the ``cpu`` transport does outside the GPU, each step timed on its own:

* ``old``: the first version: each tensor copied (``t.to("cpu", copy=True)``), the list of
  tensors pickled (torch pickles each storage through ``torch.save``), unpickled.
* ``new``: ``CPUTransport``: the bucket flattened into one reused host buffer, sent as a numpy
  ``uint8`` array (one ``bytes`` in a pickle), unpickled, split into views (``unflatten``).

``pickle`` is in-band pickling (what vLLM's engine process got first); ``pickle5`` passes
buffers out of band, as Ray's object store does; ``shm`` is what ``VLLMGenerateEngine`` sends
vLLM's engine process now (``vllm.extension.to_payload``: buffers through ``/dev/shm`` files reused
from one sync to the next, mapped by the receiver; the RPC itself, metadata only, is not timed). What a GPU adds (device-to-host copies into pageable vs pinned memory) is measured
on the GPU machine by ``benchmarks/weight_sync_bench.py``.

    python benchmarks/weight_sync_cpu_bench.py [--gib 1] [--repeats 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import pickle
import platform
import statistics
import time

import torch

SHAPES = [(151936, 896)] + [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864),
                            (896,), (896,), (896,), (128,), (128,)] * 24
"""Tensor shapes of a 0.5B Qwen2-like model (embedding + 24 layers); repeated to reach ``--gib``."""


def weights(gib: float) -> list[tuple[str, torch.Tensor]]:
    out, total, i = [], 0, 0
    while total < gib * 2**30:
        shape = SHAPES[i % len(SHAPES)]
        t = torch.randn(shape)
        out.append((f"w{i}", t))
        total += t.numel() * 4
        i += 1
    return out


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def old_path(named, protocol: int) -> dict[str, float]:
    """The first ``cpu`` transport: per-tensor copies, a list of tensors through pickle."""
    payload, pack = timed(lambda: [t.to("cpu", copy=True) for _, t in named])
    blob, dumps = timed(lambda: _dumps(payload, protocol))
    got, loads = timed(lambda: _loads(blob))
    assert len(got) == len(named)
    return {"pack": pack, "pickle": dumps, "unpickle": loads, "unpack": 0.0}


def new_path(transport, named, protocol: int) -> dict[str, float]:
    """``CPUTransport``: one flat host buffer per bucket, a numpy array through pickle, views back."""
    messages, pack = timed(lambda: list(transport.send(named)))
    blob, dumps = timed(lambda: _dumps(messages, protocol))
    got, loads = timed(lambda: _loads(blob))
    out, unpack = timed(lambda: [x for m in got for x in transport.receive(m)])
    assert len(out) == len(named)
    return {"pack": pack, "pickle": dumps, "unpickle": loads, "unpack": unpack}


_POOL = None


def _dumps(obj, protocol):
    if protocol == "shm":
        from xrlhf.engines.vllm.extension import ShmPool, to_payload

        global _POOL
        _POOL = _POOL or ShmPool()  # one pool for the run, as the engine keeps one
        return "shm", to_payload(obj, _POOL)
    if protocol < 5:
        return pickle.dumps(obj, protocol=protocol)
    buffers: list = []
    return pickle.dumps(obj, protocol=5, buffer_callback=buffers.append), buffers


def _loads(blob):
    if isinstance(blob, tuple) and blob[0] == "shm":
        from xrlhf.engines.vllm.extension import from_payload

        return from_payload(blob[1])
    if isinstance(blob, tuple):
        data, buffers = blob
        return pickle.loads(data, buffers=[b.raw() for b in buffers])
    return pickle.loads(blob)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--out", default=None, help="write weight_sync_cpu.json here")
    args = p.parse_args()

    from xrlhf.weight_sync import build_transport

    named = weights(args.gib)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    transport = build_transport("cpu", bucket_bytes=args.bucket_mb << 20)
    new_path(transport, named, 4)  # warm-up: the host buffers are allocated once and reused
    result = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "bytes": nbytes, "tensors": len(named), "bucket_mb": args.bucket_mb, "repeats": args.repeats}
    rows = []
    for protocol, label in ((4, "pickle"), (5, "pickle5"), ("shm", "shm")):
        for name, run in (("old", lambda: old_path(named, protocol)),
                          ("new", lambda: new_path(transport, named, protocol))):
            if name == "old" and protocol == "shm":
                continue
            runs = [run() for _ in range(args.repeats)]
            steps = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            total = statistics.median(sum(r.values()) for r in runs)
            result[f"{name}_{label}"] = {**steps, "total": total, "gib_per_s": nbytes / total / 2**30}
            rows.append((f"{name}, {label}", *(f"{steps[k]:.3f}" for k in steps), f"{total:.3f}",
                         f"{nbytes / total / 2**30:.2f}"))
            print(rows[-1], flush=True)
    head = ("path", "pack s", "pickle s", "unpickle s", "unpack s", "total s", "GiB/s")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(r))
    print(f"{nbytes / 2**30:.2f} GiB in {len(named)} float32 tensors, buckets of {args.bucket_mb} MB, "
          f"median of {args.repeats}, {torch.get_num_threads()} torch threads")
    if args.out:
        import json
        from pathlib import Path

        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "weight_sync_cpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
