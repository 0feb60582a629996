"""The verdict on a layout that does not fit, and the change that would make it fit.

Changes are tried from the least to the most disruptive, each on the planner's inputs (a
``dataclasses.replace``), each re-planned in full; the first that fits is the advice, written as
the override that makes it (``key=value``, as ``xrlhf run`` takes them). Then the other layouts
the config could take.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from xrlhf.plan.backends import (
    as_args,
    paged,
    shard_overrides,
    sharding,
    sleep_levels,
    zero_stage,
)
from xrlhf.plan.inputs import Handle, PlanInput
from xrlhf.plan.layouts import Cluster, Layout, LayoutPlan, plan_layout
from xrlhf.plan.memory import Trainer


def lora_params(h: Handle, rank: int = 16) -> int:
    """Parameters of rank-``rank`` LoRA adapters on every linear layer of a decoder (q, k, v, o,
    gate, up, down: ``rank x (in + out)`` each)."""
    s = h.shape
    return rank * s.layers * (9 * s.hidden + 2 * s.kv_width + 3 * s.intermediate)


def _trainers(inp: PlanInput) -> list[Handle]:
    return [h for h in inp.handles if h.trainer is not None]


def _each_trainer(inp: PlanInput, change) -> PlanInput:
    for h in _trainers(inp):
        inp = inp.with_handle(replace(h, trainer=change(h.trainer)))
    return inp


def candidate_fixes(inp: PlanInput) -> Iterator[tuple[str, PlanInput]]:
    """``(overrides, changed inputs)`` from the least disruptive change to the most."""
    p = inp.get("policy")
    t = p.trainer
    if t.tokens:
        for div in (2, 4, 8):
            n = max(1024, t.tokens // div)
            yield (f"policy.train.max_tokens_per_micro_batch={n}",
                   inp.with_handle(replace(p, trainer=replace(t, tokens=n))))
    ref = inp.get("reference")
    if ref is not None and (ref.frozen.tokens or 1 << 30) > 16384:
        yield ("reference.infer.max_tokens_per_micro_batch=16384",
               inp.with_handle(replace(ref, frozen=replace(ref.frozen, tokens=16384))))
    if not t.checkpointing:
        yield ("policy.train.gradient_checkpointing=true",
               _each_trainer(inp, lambda x: replace(x, checkpointing=True)))
    r = inp.get("rollout")
    deepest = sleep_levels(r.generator.engine)[0]
    if r.anchor == p.anchor and not inp.staleness and r.generator.sleep_level < deepest:
        yield (f"policy.generate.sleep_level={deepest}",
               inp.with_handle(replace(r, generator=replace(r.generator, sleep_level=deepest))))
    yield from lower_utilization(inp)
    if p.ranks > 1:
        yield from _sharded(inp, t)
    shard = shard_overrides("reference.infer", ref.frozen.engine, "infer", 3) if ref is not None else {}
    if shard and ref.ranks > 1 and ref.frozen.zero_stage != 3:
        yield as_args(shard), inp.with_handle(replace(ref, frozen=replace(ref.frozen, engine=shard[
            "reference.infer.engine"], zero_stage=3)))
    if t.trainable is None:
        lora = replace(p, trainer=replace(t, trainable=lora_params(p)))
        no_ref = replace(inp.with_handle(lora), handles=tuple(h for h in inp.with_handle(lora).handles
                                                              if h.name != "reference"))
        yield "policy.train.lora.rank=16 (the reference becomes the policy's base)", no_ref


def lower_utilization(inp: PlanInput, step: float = 0.05) -> Iterator[tuple[str, PlanInput]]:
    """vLLM's ``gpu_memory_utilization`` lowered by ``step`` at a time, the largest first, down to
    ``step``: only where it sizes the KV cache (``kv_cache_tokens`` unset). A smaller cache holds
    fewer sequences at once (generation in waves: slower, ``plan.speed``)."""
    r = inp.get("rollout")
    g = r.generator
    if not paged(g) or g.kv_tokens is not None:
        return
    n = math.ceil(round(g.gpu_memory_utilization / step, 6)) - 1
    for i in range(n, 0, -1):
        value = round(i * step, 4)
        yield (f"policy.generate.gpu_memory_utilization={value:g}",
               inp.with_handle(replace(r, generator=replace(g, gpu_memory_utilization=value))))


def _sharded(inp: PlanInput, t: Trainer) -> Iterator[tuple[str, PlanInput]]:
    """The trainers partitioned at ZeRO stages 1-3 beyond the policy's, then 3 with the optimizer
    offloaded, by the backend that can (``plan.backends.sharding``)."""
    for stage in (1, 2, 3):
        shard = shard_overrides("policy.train", t.engine, "train", stage)
        if shard and zero_stage(t) < stage:
            yield as_args(shard), _each_trainer(inp, lambda x, s=stage: _zero(x, s))
    shard = shard_overrides("policy.train", t.engine, "train", 3, offload=True)
    if shard:
        yield as_args(shard), _each_trainer(inp, lambda x: replace(_zero(x, 3), offload_optimizer=True))


def _zero(t: Trainer, stage: int) -> Trainer:
    """``t`` partitioned at ZeRO ``stage`` by the backend that can (mixed precision, as DeepSpeed's bf16)."""
    precision = "mixed" if t.precision != "fp32" else "fp32"
    found = sharding(t.engine, "train", stage)
    return replace(t, engine=found[0] if found else t.engine, zero_stage=stage, precision=precision)


def advise(inp: PlanInput, layout: Layout, cluster: Cluster) -> tuple[str, LayoutPlan] | None:
    """The first change that makes ``layout`` fit on ``cluster``: ``(overrides, its plan)``, or
    ``None`` when none does."""
    for overrides, changed in candidate_fixes(inp):
        plan = plan_layout(changed, layout, cluster)
        if plan.fits:
            return overrides, plan
    return None
