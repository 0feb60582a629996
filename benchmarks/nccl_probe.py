"""Which NCCL and cuMem paths work on this machine (issue 29: the first two-GPU call failed in
vLLM's PyNccl warm-up all-reduce, "unhandled cuda error", and TRL's vLLM in ``wake_up``, "illegal
memory access"). Each case runs in fresh processes, one per GPU, each seeing only its own GPU
(``CUDA_VISIBLE_DEVICES``, as Ray gives an actor), under a few NCCL settings; and vLLM's
``CuMemAllocator`` sleep/wake with one GPU visible and with both. Prints one line per case and
writes ``nccl_probe.json``::

    python -m benchmarks.nccl_probe --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"default": {}, "cumem0": {"NCCL_CUMEM_ENABLE": "0"}, "p2p0": {"NCCL_P2P_DISABLE": "1"},
            "cumem0-p2p0": {"NCCL_CUMEM_ENABLE": "0", "NCCL_P2P_DISABLE": "1"}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(kind: str, rank: int, port: int) -> None:
    import torch

    t = torch.full((1 << 20,), float(rank + 1), device="cuda:0")
    if kind == "torch":
        import torch.distributed as dist

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
    elif kind == "pynccl":
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=2, store_timeout=60)
        comm = PyNcclCommunicator(pg, device=torch.device("cuda:0"))
        comm.broadcast(t, src=0, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    print(f"OK {float(t[0])}")


def cumem(both: bool) -> str:
    code = ("import torch\nfrom vllm.device_allocator.cumem import CuMemAllocator\n"
            "a = CuMemAllocator.get_instance()\n"
            "with a.use_memory_pool(tag='kv_cache'):\n    x = torch.ones(1 << 24, device='cuda')\n"
            "a.sleep(offload_tags=())\na.wake_up(['kv_cache'])\nx.fill_(2.0)\n"
            "y = torch.tensor([x.data_ptr()], dtype=torch.int64, device='cuda')\ntorch.cuda.synchronize()\n"
            "print('OK', float(x.sum()), int(y[0]) != 0)\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1" if both else "0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return "ok" if p.returncode == 0 and "OK" in p.stdout else (p.stdout + p.stderr)[-600:]


def pair(kind: str, extra: dict[str, str], log) -> str:
    port = _port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(rank), **extra)
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.nccl_probe", "--child", kind, str(rank),
                                       str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append("timeout")
    log.write(f"== {kind} {extra}\n" + "\n".join(outs) + "\n")
    if all(p.returncode == 0 for p in procs):
        return "ok"
    err = [ln for o in outs for ln in o.splitlines() if "rror" in ln or "timeout" in ln]
    return (err[-1] if err else "failed")[-300:]


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with open(out / "nccl_probe.log", "w") as log:
        for both in (False, True):
            t = time.time()
            results[f"cumem sleep/wake, {'both GPUs' if both else 'one GPU'} visible"] = r = cumem(both)
            print(f"cumem both={both}: {r} ({time.time() - t:.0f}s)", flush=True)
        for name in args.settings.split(","):
            for kind in ("torch", "pynccl"):
                t = time.time()
                extra = dict(SETTINGS[name], NCCL_DEBUG="INFO" if name == "default" else "WARN")
                results[f"{kind} {name}"] = r = pair(kind, extra, log)
                print(f"{kind} {name}: {r} ({time.time() - t:.0f}s)", flush=True)
    (out / "nccl_probe.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
