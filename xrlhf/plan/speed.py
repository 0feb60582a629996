"""A step's planned time, phase by phase: a roofline model small enough to state in a table.

Why a model: the layouts that fit (``plan.search``) are ranked by how fast a step would run, and
nothing can be timed before the run. Each phase (generate, infer, train, sync) is a bound by HBM
bandwidth, FLOPs at an efficiency, or the host's work per sequence; the step is their sum, except
a split layout one step off: ``max(generate, infer + train) + sync``. Every sequence is taken at
its full length. Every constant is in ``GPU_KINDS`` or ``Speeds``; ``xrlhf plan --speed
NAME=VALUE`` replaces one. The formulas, the constants' sources and the checks against measured
runs (tests/plan/test_search.py): docs/plan.md ("Planned step time").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from xrlhf.plan.backends import paged, zero_stage
from xrlhf.plan.inputs import Handle, PlanInput
from xrlhf.plan.memory import kv_tokens_held
from xrlhf.utils.errors import UserError


@dataclass(frozen=True)
class GPUKind:
    """A GPU as the time model sees it (NVIDIA's datasheets: SXM parts, dense bf16)."""

    name: str
    memory_gib: float
    """Its memory as torch reports it."""
    hbm_tb_s: float
    tflops: float


GPU_KINDS = {
    "h100": GPUKind("H100 SXM 80GB", 79.2, 3.35, 989.0),
    "h200": GPUKind("H200 SXM 141GB", 139.8, 4.8, 989.0),
    "a100": GPUKind("A100 SXM 80GB", 79.2, 2.039, 312.0),
}
"""HBM bandwidth (TB/s) and dense bf16 peak (TFLOP/s) from NVIDIA's datasheets."""


@dataclass(frozen=True)
class Speeds:
    """The time model's constants (``--speed NAME=VALUE`` replaces one).

    Attributes:
        hbm_tb_s, tflops: one GPU's HBM bandwidth and dense bf16 peak (``GPU_KINDS``).
        mfu: the share of ``tflops`` a train step and a forward reach (fitted to measured runs,
            rounded down for eager layers and larger models).
        decode_mfu: the same for a decode step's matrix products (assumed: the measured decode
            steps are bound by the host and HBM).
        host_us_per_seq: vLLM's host work per sequence and decode step, in µs (measured).
        tp_efficiency: a decode step's speed-up over ``tp`` GPUs is ``tp x`` this (assumed: the
            all-reduces of each layer; no tensor-parallel run measured yet).
        zero3_efficiency: a ZeRO-3 train step's speed against one whose weights are whole on
            each rank (assumed: it gathers every layer's weights in the forward and again in the
            backward, 1.5x DDP's traffic; not measured yet).
    """

    hbm_tb_s: float = 4.8
    tflops: float = 989.0
    mfu: float = 0.5
    decode_mfu: float = 0.5
    host_us_per_seq: float = 20.0
    tp_efficiency: float = 0.85
    zero3_efficiency: float = 0.85


def gpu_kind(gpu_gib: float, name: str | None = None) -> GPUKind:
    """The GPU kind called ``name``, or the one whose memory is nearest ``gpu_gib`` (``h100`` or
    ``h200``; an 80 GB ``a100`` has the same memory as ``h100``: ``--gpu-kind a100``)."""
    if name is not None:
        if name not in GPU_KINDS:
            raise UserError(f"--gpu-kind {name}: unknown; valid: {', '.join(GPU_KINDS)}")
        return GPU_KINDS[name]
    return min((GPU_KINDS["h100"], GPU_KINDS["h200"]), key=lambda k: abs(k.memory_gib - gpu_gib))


def speeds_for(kind: GPUKind, overrides: list[str] | None = None) -> Speeds:
    """``Speeds`` of ``kind`` with ``NAME=VALUE`` overrides (``--speed``)."""
    s = replace(Speeds(), hbm_tb_s=kind.hbm_tb_s, tflops=kind.tflops)
    names = [f.name for f in fields(Speeds)]
    for item in overrides or []:
        key, _, value = item.partition("=")
        if key not in names:
            raise UserError(f"--speed {item}: unknown constant {key!r}; valid: {', '.join(names)}")
        try:
            s = replace(s, **{key: float(value)})
        except ValueError:
            raise UserError(f"--speed {item}: give NAME=NUMBER, e.g. mfu=0.4") from None
    return s


@dataclass(frozen=True)
class StepTime:
    """A step's planned seconds by phase, and the step's (``total``)."""

    generate: float
    infer: float
    train: float
    sync: float
    total: float


def generate_seconds(inp: PlanInput, kv_held: int, s: Speeds) -> float:
    """vLLM's generate phase: every engine decodes its share at once (``kv_held``: tokens its KV
    cache holds, 0: unknown, as many as asked). The Transformers generator is planned as vLLM."""
    r, w = inp.get("rollout"), inp.workload
    g, shape = r.generator, r.shape
    tp, dp = max(1, g.tp), max(1, r.ranks)
    seqs = math.ceil(w.sequences / dp)
    at_once = min(seqs, g.max_num_seqs)
    if kv_held > 0:
        at_once = max(1, min(at_once, kv_held // max(w.seq_len, 1)))
    waves = math.ceil(seqs / at_once)
    context = w.prompt_tokens + w.new_tokens / 2
    read = shape.params * g.dtype_bytes / tp + at_once * context * shape.kv_bytes_per_token(g.dtype_bytes) / tp
    flops = 2 * shape.params * at_once / tp
    gpu = max(read / (s.hbm_tb_s * 1e12), flops / (s.tflops * 1e12 * s.decode_mfu))
    if tp > 1:
        gpu /= s.tp_efficiency
    step = gpu + s.host_us_per_seq * 1e-6 * at_once
    prefill = 2 * shape.params * seqs * w.prompt_tokens / (s.tflops * 1e12 * s.mfu * tp)
    return waves * w.new_tokens * step + prefill


def _flops_seconds(flops: float, ranks: int, s: Speeds, zero3: bool = False) -> float:
    eff = s.mfu * (s.zero3_efficiency if zero3 and ranks > 1 else 1.0)
    return flops / (max(1, ranks) * s.tflops * 1e12 * eff)


def _trained_flops_per_token(h: Handle) -> float:
    t = h.trainer
    p = h.shape.head_params(t.head)
    per = 4 * p if t.trainable is not None else 6 * p  # LoRA: no weight gradients of the base
    return per + (2 * p if t.checkpointing else 0)  # the forward again in the backward


def infer_seconds(inp: PlanInput, s: Speeds) -> float:
    """Forwards without gradients: frozen models, the critic's values, the policy's old logprobs."""
    tokens = inp.workload.sequences * inp.workload.seq_len
    out = 0.0
    for h in inp.handles:
        if h.frozen is not None:
            out += _flops_seconds(2 * h.shape.head_params(h.frozen.head) * tokens, h.ranks, s, h.frozen.zero_stage == 3)
        elif h.trainer is not None and (h.name != "policy" or inp.workload.old_logprobs):
            zero3 = zero_stage(h.trainer) == 3
            out += _flops_seconds(2 * h.shape.head_params(h.trainer.head) * tokens, h.ranks, s, zero3)
    return out


def train_seconds(inp: PlanInput, s: Speeds) -> float:
    """Every trained handle's epochs over the step's tokens."""
    w = inp.workload
    tokens = w.sequences * w.seq_len * w.epochs
    out = 0.0
    for h in inp.handles:
        if h.trainer is not None:
            zero3 = zero_stage(h.trainer) == 3
            out += _flops_seconds(_trained_flops_per_token(h) * tokens, h.ranks, s, zero3)
    return out


def step_time(inp: PlanInput, split: bool, kv_held: int, sync_s: float, s: Speeds) -> StepTime:
    """The step's planned time (see the module's docstring for how the phases add up)."""
    gen, inf, tr = generate_seconds(inp, kv_held, s), infer_seconds(inp, s), train_seconds(inp, s)
    if split and inp.staleness > 0:
        total = max(gen, inf + tr) + sync_s
    else:
        total = gen + inf + tr + sync_s
    return StepTime(gen, inf, tr, sync_s, total)


def kv_held_of(inp: PlanInput, parts: dict[str, int] | None) -> int:
    """Tokens one generator's KV cache holds, from its planned parts (0: not planned)."""
    r = inp.get("rollout")
    if not parts or not paged(r.generator):
        return 0
    return kv_tokens_held(r.shape, r.generator, parts)
