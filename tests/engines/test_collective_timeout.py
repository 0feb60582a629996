"""fault_tolerance.collective_timeout_s reaches torch.distributed: a collective whose peer never
joins it fails after the timeout instead of hanging (the worker is then healed as a dead one)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

from xrlhf.engines.base import DistInfo


def _rank(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    DistInfo(rank, 2, "127.0.0.1", port, "gloo", timeout_s=2.0).init_process_group()
    if rank == 1:
        time.sleep(15)  # alive, but never enters the all-reduce
        return
    t0 = time.time()
    try:
        dist.all_reduce(torch.ones(4))
        out.put(("returned", time.time() - t0))
    except Exception as e:  # noqa: BLE001 - the point: it raises
        out.put((type(e).__name__, time.time() - t0))


def test_a_collective_without_its_peer_fails_after_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        what, seconds = out.get(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert what != "returned" and 1.5 < seconds < 10, (what, seconds)
