"""Weight sync: the bytes each sync moves and the time each transport takes at given link speeds.

A sync sends the policy's weights in the generators' dtype (a merged LoRA policy too), or only
the LoRA adapter (``lora.sync: adapter``, fp32). Speeds are GiB/s of the whole transfer, each
one measured here or nominal (``LINKS``; ``--link NAME=GIB_S`` replaces one):

* ``cuda_ipc``: 5.3, measured: a run's sync phase with verify on (bucket by bucket from the
  policy's process into vLLM's, checksums read back; docs/vllm.md);
* ``cpu``: 4.2, measured: through pinned memory and ``/dev/shm`` (docs/vllm.md);
* ``disk``: 1.97, measured: safetensors files in TMPDIR (docs/vllm.md);
* ``nvlink``: 300, nominal: a node's NVLink (Hopper generation) for an NCCL broadcast inside a node;
* ``ib``: 40, nominal: a 400 Gb/s InfiniBand port per GPU, NCCL between nodes (at ~85%).

``nccl`` broadcasts from the policy's rank 0 to every generator (a pipelined broadcast costs
about one transfer over its slowest link); a ZeRO-3 policy first gathers its weights across its
ranks (``(r - 1) / r`` of the bytes over the same kind of link).
"""

from __future__ import annotations

from dataclasses import dataclass

from xrlhf.plan.backends import zero_stage
from xrlhf.plan.inputs import PlanInput
from xrlhf.weight_sync import choose_transport

LINKS = {"cuda_ipc": 5.3, "cpu": 4.2, "disk": 1.97, "nvlink": 300.0, "ib": 40.0}
MEASURED = {"cuda_ipc", "cpu", "disk"}


@dataclass(frozen=True)
class SyncRow:
    """One transport's cost for one sync: ``bytes`` per generator, ``seconds`` per sync, the
    link it is limited by, whether it is the one the run uses."""

    transport: str
    bytes: int
    seconds: float
    link: str
    chosen: bool


def sync_bytes(inp: PlanInput) -> int:
    """Bytes one sync sends to each generator."""
    r = inp.get("rollout")
    g = r.generator
    if g.lora_bytes:
        return g.lora_bytes
    return r.shape.params * g.dtype_bytes


def sync_rows(inp: PlanInput, split: bool, gpus_per_node: int, links: dict[str, float] | None = None
              ) -> list[SyncRow]:
    """Every transport that works in the layout, with its bytes and seconds (``links`` replaces
    entries of ``LINKS``)."""
    speed = {**LINKS, **(links or {})}
    n = sync_bytes(inp)
    p, r = inp.get("policy"), inp.get("rollout")
    chosen = choose_transport(inp.transport, colocated=not split, gpu=True)
    rows = []
    if split:
        policy_gpus = p.ranks * max(1, int(p.gpus))
        gen_gpus = r.ranks * r.generator.tp
        link = "nvlink" if policy_gpus + gen_gpus <= gpus_per_node else "ib"
        gather = 0.0
        t = p.trainer
        if t is not None and zero_stage(t) == 3 and p.ranks > 1:
            gather = n * (p.ranks - 1) / p.ranks / (speed[link] * 2**30)
        rows.append(SyncRow("nccl", n, gather + n / (speed[link] * 2**30), link, chosen == "nccl"))
    else:
        rows.append(SyncRow("cuda_ipc", n, n / (speed["cuda_ipc"] * 2**30), "cuda_ipc", chosen == "cuda_ipc"))
    for name in ("cpu", "disk"):
        rows.append(SyncRow(name, n, n / (speed[name] * 2**30), name, chosen == name))
    return rows
