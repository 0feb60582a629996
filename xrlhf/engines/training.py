"""What every train backend's ``backward`` / ``optimizer_step`` and the train template share: the
LR schedule, the data-parallel gradient sum, loss units and unit-weighted metrics, a merged
checkpoint state. Kept apart from any one backend so that a custom engine (see
docs/extending.md) uses them without importing the Transformers backend."""

from __future__ import annotations

import math
from typing import Any

import torch

from xrlhf.data.batch import Batch


def lr_lambda(warmup: int, total: int, schedule: str):
    """LR multiplier per optimizer step: linear warm-up, then constant or cosine to 10%."""

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine" and total > warmup:
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return fn


def schedule_uses_total(schedule: str) -> bool:
    """Whether :func:`lr_lambda`'s multipliers depend on ``total`` (the run's optimizer steps):
    a cosine decays over the run, so a run continued to more steps would not have had the same
    LRs; a constant schedule (after its warm-up) does not care how long the run is."""
    return schedule == "cosine"


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients over the data-parallel group, in one flat buffer per dtype."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        group = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat)
        offset = 0
        for g in group:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def max_over_ranks(n: int, device: torch.device) -> int:
    """The largest ``n`` over the data-parallel group (``n`` itself without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def estimate_train_gib(params: int, dtype_bytes: int, micro_batch: int, seq_len: int, hidden: int, layers: int,
                       vocab: int, frozen_params: int = 0, intermediate: int | None = None) -> float:
    """A rough peak of one data-parallel rank training a causal LM with AdamW (GiB).

    ``params`` weights, gradients and two Adam states in ``dtype_bytes`` each; ``frozen_params``
    (a reference model on the same device) once; activations kept for backward of a
    ``micro_batch`` x ``seq_len`` micro-batch, per layer and token ~10 tensors of ``hidden`` and 4
    of the MLP's ``intermediate`` width (default 4 x hidden), in the weights' dtype; the logits
    and their fp32 temporaries (5 x vocab per token: logits, scaled, log-softmax, entropy,
    gradient); all times 1.3 for the allocator's fragmentation and the CUDA context (its
    calibration: docs/async.md). An estimate: a plan near the limit can still fail at run time.
    """
    intermediate = intermediate or 4 * hidden
    state = params * dtype_bytes * 4 + frozen_params * dtype_bytes
    tokens = micro_batch * seq_len
    activations = tokens * layers * (10 * hidden + 4 * intermediate) * dtype_bytes + tokens * vocab * 4 * 5
    return 1.3 * (state + activations) / 2**30


def unit_weighted_means(records: list[tuple[float, dict[str, Any]]]) -> dict[str, float]:
    """The train template's metrics: each micro-batch's values weighted by its loss units.

    Args:
        records: per micro-batch, ``(units, {name: value})``; a value is a number or a 0-d tensor
            (on any device: still running there, the caller never waited for it).

    Returns:
        ``{name: sum(value * units) / max(sum(units), 1)}`` over the micro-batches that have the
        name; a name ending in ``_max`` is a maximum: the largest value of the micro-batches.

    Every tensor is read in one transfer (``tolist`` of a stack per device), so a train step
    waits for its device once, after its last backward was queued, not once per micro-batch. The
    arithmetic is the per-micro-batch loop's: float64 values summed in micro-batch order.
    """
    tensors = [v for _, m in records for v in m.values() if isinstance(v, torch.Tensor)]
    host: dict[int, float] = {}
    for device in {t.device for t in tensors}:
        same = [t for t in tensors if t.device == device]
        read = torch.stack([t.detach().reshape(()).to(torch.float64) for t in same]).tolist()
        host.update(zip(map(id, same), read))
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    total = 0.0
    for units, metrics in records:
        for k, v in metrics.items():
            value = host[id(v)] if isinstance(v, torch.Tensor) else float(v)
            if k.endswith("_max"):
                maxima[k] = max(maxima.get(k, value), value)
            else:
                sums[k] = sums.get(k, 0.0) + value * units
        total += units
    return {**{k: v / max(total, 1.0) for k, v in sums.items()}, **maxima}


def loss_units(batch: Batch, unit: str) -> torch.Tensor:
    """The number of loss units in ``batch``: response tokens (``unit == "token"``) or rows (the
    sum of ``row_weight`` where a data-parallel split padded the batch with copies of weight 0)."""
    if unit == "token":
        return batch["response_mask"].sum()
    return batch["row_weight"].sum().float() if "row_weight" in batch else torch.tensor(float(len(batch)))


def global_units(batch: Batch, unit: str, device: torch.device) -> torch.Tensor:
    """Number of loss units (tokens or rows) in the global mini-batch, summed over ranks."""
    import torch.distributed as dist

    n = loss_units(batch, unit).to(device=device, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(n)
    return n.clamp(min=1.0)


def merge_rank_states(states: list[Any]) -> Any:
    """One state every rank can load, from each rank's ``TrainEngine.state_dict()``.

    Replicated engines: rank 0's. Sharded engines (DeepSpeed ZeRO) return
    ``{"shard_files": {name: bytes}, ...}``; the result holds the union of all ranks' files.
    """
    first = states[0]
    if not (isinstance(first, dict) and "shard_files" in first):
        return first
    files: dict[str, Any] = {}
    for s in states:
        files.update(s["shard_files"])
    return {**first, "shard_files": files}
