"""Weight-sync time of the 0.5B model into a vLLM engine, per transport, against a plain copy.

The trainer's weights (the HF model in bfloat16, as ``HFTrainEngine.named_weights`` yields
them) go into a vLLM engine on GPU 0 through the same code a co-located worker runs
(``push_weights`` into ``VLLMGenerateEngine.receive_weights``, then ``end_sync``):

* ``cpu``: copies in CPU memory, pickled into vLLM's engine process (the object-store path);
* ``cuda_ipc``: trainer on GPU 0 beside vLLM, one zero-copy handle per tensor
  (``cuda_ipc_packed``: one flat buffer per bucket);
* ``disk``: a safetensors file per bucket in ``--disk-dir`` (default: under ``TMPDIR``),
  memory-mapped by vLLM's worker;
* ``nccl``: trainer on GPU 1, broadcast (needs 2 GPUs; ``null`` with the reason otherwise);
* ``d2d_copy_seconds``: copying every tensor into preallocated tensors on GPU 0, the floor.

Steady state: each transport is built once, synced once to warm up (first mappings, pinned
buffers, the allocator, the NCCL group), then timed over ``--repeats`` syncs; the median is
reported, with verify off (``seconds``) and, on a second transport, with verify on
(``verified_seconds``). Opening the NCCL group is not part of a sync: it is timed on its own
(``nccl_setup_seconds``, from the sender's side of each of the two groups). An earlier version
timed one verified sync on a fresh transport, which for NCCL included the group's set-up
(0.6-1.0 s against 0.067 s for verified syncs in a run).
``cuda_ipc_sleep_cycle_seconds`` is the co-located sync as a step runs it: vLLM asleep at
level 2, woken for the weights, loaded, its KV cache woken.

    python benchmarks/weight_sync.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

from benchmarks.common import MODEL_05B, ensure_model, gpu_name, table, vllm_options, write_json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: artifacts/model-0.5b (built if missing)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--disk-dir", default=None, help="the disk transport's directory (default: under TMPDIR)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.vllm import VLLMGenerateEngine
    from xrlhf.weight_sync import build_transport, checksum, compare_checksums, push_weights

    model = ensure_model(args.model or MODEL_05B)
    # vLLM's engine core in a process of its own, as the trainer and the generator are in a run: a
    # process cannot map its own CUDA IPC handles, and vLLM in-process sets this one's torch to one thread
    engine = VLLMGenerateEngine(EngineSpec(model, device="cuda", options=vllm_options(
        gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=2, max_model_len=1024, max_num_seqs=64,
        dtype="bfloat16", multiprocessing=True)))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to("cuda:0")
    weights = list(hf.state_dict().items())  # what HFTrainEngine.named_weights yields (tied lm_head included)
    sent_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    model_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    bucket = args.bucket_mb << 20

    def sync(transport, named) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        push_weights(transport, named, engine.receive_weights)
        engine.end_sync()
        return time.perf_counter() - t0

    def steady(transport, named, repeats: int) -> list[float]:
        sync(transport, named)  # warm-up: first mappings, pinned buffers, NCCL group, allocator
        return [sync(transport, named) for _ in range(repeats)]

    def median(name: str, make, named, repeats: int) -> float:
        """Median steady-state sync, verify off; the same with verify on into ``verified`` (last:
        the read-back needs a verified sync)."""
        off = make(False)
        times = steady(off, named, repeats)
        on = make(True)
        verified[name] = statistics.median(steady(on, named, repeats))
        if getattr(off, "setup_seconds", None) is not None:
            setup[name] = {"verify_off": off.setup_seconds, "verify_on": on.setup_seconds}
        print(f"{name}: {[round(t, 4) for t in times]} s; verified {verified[name]:.3f} s", flush=True)
        return statistics.median(times)

    verified: dict[str, float] = {}
    setup: dict[str, dict[str, float]] = {}
    seconds: dict[str, float | None] = {}
    seconds["cpu"] = median("cpu", lambda v: build_transport("cpu", bucket_bytes=bucket, verify=v), weights,
                            args.repeats)
    seconds["cuda_ipc"] = median("cuda_ipc", lambda v: build_transport("cuda_ipc", bucket_bytes=bucket, verify=v),
                                 weights, args.repeats)
    extra = {"cuda_ipc_packed": median("cuda_ipc_packed", lambda v: build_transport(
        "cuda_ipc", bucket_bytes=bucket, verify=v, packed=True), weights, args.repeats)}
    want = {n: checksum(t) for n, t in weights}
    compare_checksums(want, engine.weight_checksums(), "vLLM")  # what arrived is the trainer's, bit for bit
    seconds["disk"] = median("disk", lambda v: build_transport("disk", bucket_bytes=bucket, verify=v,
                                                               directory=args.disk_dir), weights, args.repeats)
    compare_checksums(want, engine.weight_checksums(), "vLLM")

    cycles = []
    ipc = build_transport("cuda_ipc", bucket_bytes=bucket)
    for _ in range(args.repeats):
        engine.sleep()
        cycles.append(sync(ipc, weights))
    extra["cuda_ipc_sleep_cycle"] = statistics.median(cycles)

    nccl_note = None
    if torch.cuda.device_count() >= 2:
        on_gpu1 = [(n, t.to("cuda:1")) for n, t in weights]
        port = free_port()
        seconds["nccl"] = median("nccl", lambda v: build_transport(
            "nccl", bucket_bytes=bucket, verify=v, host="127.0.0.1", port=port if not v else free_port(),
            world_size=2, rank=0, timeout_s=120), on_gpu1, args.repeats)
        compare_checksums(want, engine.weight_checksums(), "vLLM")
    else:
        seconds["nccl"] = None
        nccl_note = "one GPU: NCCL cannot put the trainer and vLLM on the same GPU"

    dst = [torch.empty_like(t) for _, t in weights]
    copies = []
    for _ in range(args.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, (_, s) in zip(dst, weights):
            d.copy_(s)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
    d2d = statistics.median(copies[1:])
    sums = checksum_seconds(weights, args.repeats)
    engine.shutdown()

    result = {"gpu": gpu_name(), "bytes": sent_bytes, "model_bytes": model_bytes, "tensors": len(weights),
              "bucket_mb": args.bucket_mb, "seconds": seconds, "d2d_copy_seconds": d2d,
              **{f"{k}_seconds": v for k, v in extra.items()},
              "verified_seconds": verified, "verified_is": "median of steady-state syncs after a warm-up",
              "nccl_setup_seconds": setup.get("nccl"), "disk_dir": args.disk_dir or "TMPDIR",
              "nccl_note": nccl_note, "repeats": args.repeats, "checksum_seconds": sums}
    write_json(args.out, "weight_sync.json", result)
    rows = [(k, v, sent_bytes / v / 2**30 if v else None, verified.get(k)) for k, v in
            [*seconds.items(), ("cuda_ipc_packed", extra["cuda_ipc_packed"]),
             ("cuda_ipc_sleep_cycle", extra["cuda_ipc_sleep_cycle"]), ("d2d_copy", d2d)]]
    print(table(rows, ["transport", "seconds", "GiB/s", "verified s"]))
    if setup.get("nccl"):
        print(f"nccl group set-up (not part of a sync): {setup['nccl']['verify_off']:.3f} s, "
              f"{setup['nccl']['verify_on']:.3f} s for the verified transport's group")
    print(f"{result['gpu']}, {sent_bytes / 2**30:.2f} GiB in {len(weights)} tensors "
          f"(targets: cuda_ipc < 0.2 s, nccl < 0.5 s, cpu >= 2 GiB/s)" + (f"; nccl: {nccl_note}" if nccl_note else ""))
    print(f"checksums of every tensor (one side of a verified sync): {sums['one_wait_per_tensor']:.3f} s waiting "
          f"for the GPU after each tensor, {sums['one_wait']:.3f} s waiting once")


def checksum_seconds(weights, repeats: int) -> dict[str, float]:
    """What verify costs one side of a sync: ``checksum`` of every tensor, the device waited for after each
    (how a sync checked before ``checksums``) and once for all of them (how it checks now); medians after a
    warm-up."""
    import torch

    from xrlhf.weight_sync import checksum, checksums

    wait = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    ways = {"one_wait_per_tensor": lambda: [checksum(t) for _, t in weights],
            "one_wait": lambda: checksums(t for _, t in weights)}
    out = {}
    for name, fn in ways.items():
        times = []
        for _ in range(repeats + 1):
            wait()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:])
    return out


if __name__ == "__main__":
    main()
