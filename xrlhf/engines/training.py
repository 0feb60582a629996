"""What every train backend's ``backward`` / ``optimizer_step`` may share: the LR schedule and
the data-parallel gradient sum. Kept apart from any one backend so that a custom engine (see
docs/extending.md) uses them without importing the Transformers backend."""

from __future__ import annotations

import math

import torch


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
