"""A validated config turned into the planner's inputs: handles, their engines' memory options,
the step's workload. The one place that reads ``XConfig``; the memory model and the layouts
work on these plain dataclasses, so a fix ("ZeRO-3", "a split") is a ``dataclasses.replace``.

Engine options are validated by each engine's own ``Options`` (no package checks: a plan for
vLLM is made where vLLM is not installed). Defaults a run decides by device are taken for a GPU
(mixed precision with bf16, token budgets derived from free memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from xrlhf.config.loader import format_errors
from xrlhf.config.schema import XConfig
from xrlhf.plan.backends import backend
from xrlhf.plan.memory import VLLM_BATCHED_TOKENS, Generator, Trainer
from xrlhf.plan.shapes import ModelShape, model_shape
from xrlhf.utils.errors import UserError


@dataclass(frozen=True)
class Frozen:
    """A frozen model's engine (reference, reward): its dtype, ZeRO-3 partitioning, token budget."""

    head: str = "causal_lm"
    engine: str = "hf"
    """The infer backend (a name or an import path), asked through ``plan.backends``."""
    dtype_bytes: int = 2
    zero_stage: int = 0
    ranks: int = 1
    tokens: int | None = None
    chunk: int = 1024
    rows: int = 0
    compiled: bool = False
    """Its decoder layers compiled (a forward holds less per token: ``engines.budget``)."""


@dataclass(frozen=True)
class Handle:
    """One handle of the run: where it is placed and what its engine holds.

    ``anchor``: the handle whose GPUs it shares (itself when it has its own); ``gpus``: GPUs
    per rank (0: on CPU). Exactly one of ``trainer``, ``frozen``, ``generator`` is set."""

    name: str
    shape: ModelShape
    ranks: int
    gpus: float
    anchor: str
    trainer: Trainer | None = None
    frozen: Frozen | None = None
    generator: Generator | None = None


@dataclass(frozen=True)
class Workload:
    """The step: ``sequences`` (prompts x samples) of up to ``prompt_tokens + new_tokens``;
    ``mini_batch``: sequences per optimizer step; ``old_logprobs``: whether the policy runs a
    forward without gradients before training (skipped for one on-policy step); ``epochs``:
    passes over the batch per step (``ppo_epochs``)."""

    sequences: int
    prompt_tokens: int
    new_tokens: int
    mini_batch: int
    old_logprobs: bool = True
    epochs: int = 1

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.new_tokens


@dataclass(frozen=True)
class PlanInput:
    """Everything a plan reads: the handles, the step, the rollout mode and the weight sync."""

    handles: tuple[Handle, ...]
    workload: Workload
    staleness: int = 0
    transport: str = "auto"
    bucket_bytes: int = 256 << 20
    notes: tuple[str, ...] = field(default_factory=tuple)

    def get(self, name: str) -> Handle | None:
        return next((h for h in self.handles if h.name == name), None)

    def with_handle(self, h: Handle) -> PlanInput:
        return replace(self, handles=tuple(h if x.name == h.name else x for x in self.handles))


def _options(section, role: str, path: str):
    from xrlhf.engines.base import engine_options

    try:
        return engine_options(section.engine, role, section.engine_fields(), path)
    except KeyError as e:
        raise UserError(f"{path}.engine: {e.args[0]}") from None
    except ValidationError as e:
        raise UserError(*format_errors(e, None, path)) from None


def _chunk(o, head: str, shape: ModelShape) -> int:
    """The logprob chunk an engine with options ``o`` takes on a GPU (0: no chunked head)."""
    tokens = getattr(o, "chunk_tokens", None)
    return tokens("cuda", shape.vocab) if head == "causal_lm" and tokens is not None else 0


def _trainer(section, path: str, head: str, ranks: int, adapter_params: int | None, shape: ModelShape) -> Trainer:
    o = _options(section, "train", path)
    mixed = getattr(o, "mixed_precision", None)
    precision = "fp32" if o.dtype == "float32" else ("bf16" if mixed is False else "mixed")
    budget = o.max_tokens_per_micro_batch
    infer = o.infer_max_tokens_per_micro_batch or budget
    return Trainer(head=head, engine=section.engine, precision=precision,
                   trainable=adapter_params, zero_stage=backend(section.engine, "train").shard_stage(o),
                   offload_optimizer=getattr(o, "offload_optimizer", False),
                   offload_params=getattr(o, "offload_params", False), ranks=ranks, tokens=budget,
                   infer_tokens=infer, checkpointing=o.gradient_checkpointing,
                   chunk=_chunk(o, head, shape), rows=o.micro_batch_size if budget else 0,
                   compiled=o.compiles("cuda"))


def _frozen(section, path: str, head: str, ranks: int, shape: ModelShape) -> Frozen:
    o = _options(section, "infer", path)
    return Frozen(head=head, engine=section.engine, dtype_bytes=4 if o.dtype == "float32" else 2,
                  zero_stage=backend(section.engine, "infer").shard_stage(o),
                  ranks=ranks, tokens=o.max_tokens_per_micro_batch,
                  chunk=_chunk(o, head, shape), rows=o.micro_batch_size if o.max_tokens_per_micro_batch else 0,
                  compiled=bool(getattr(o, "compiles", lambda device: False)("cuda")))


def _generator(cfg: XConfig, shape: ModelShape, work: Workload, lora_bytes: int) -> Generator:
    g = cfg.policy.generate
    o = _options(g, "generate", "policy.generate")
    dtype = 4 if o.dtype == "float32" else 2
    batch = work.sequences * work.seq_len
    if backend(g.engine, "generate").memory_model != "paged":
        return Generator(engine=g.engine, dtype_bytes=dtype, max_num_seqs=work.sequences, sleep_level=0,
                         batch_tokens=batch)
    kv = o.kv_cache_tokens
    if kv == "batch":
        kv = o.max_num_seqs * o.max_model_len
    return Generator(engine=g.engine, dtype_bytes=dtype, tp=o.tensor_parallel_size,
                     gpu_memory_utilization=o.gpu_memory_utilization, kv_tokens=kv, max_num_seqs=o.max_num_seqs or 256,
                     batched_tokens=o.max_num_batched_tokens or VLLM_BATCHED_TOKENS, enforce_eager=o.enforce_eager,
                     torch_compile=bool(o.torch_compile), sleep_level=o.sleep_level, batch_tokens=batch, lora_bytes=lora_bytes)


def _workload(cfg: XConfig, prompt_tokens: int) -> Workload:
    t, a = cfg.trainer, cfg.algorithm.options()
    sequences = t.prompts_per_step * t.samples_per_prompt
    mini = int(a.get("mini_batch_size", 32 if cfg.algorithm.name in ("ppo", "grpo") else sequences))
    epochs = int(a.get("ppo_epochs", 1))
    one_step = epochs == 1 and mini >= sequences and not cfg.policy.train.dropout
    return Workload(sequences, prompt_tokens, cfg.policy.generate.max_new_tokens, min(mini, sequences),
                    old_logprobs=not one_step, epochs=epochs)


def plan_input(cfg: XConfig, prompt_tokens: int = 64) -> PlanInput:
    """The planner's inputs for ``cfg`` (``prompt_tokens``: a prompt's length, which the config
    does not say; the env knows it only once its tokenizer and data are read)."""
    from xrlhf.topology import (
        generator_resources,
        placements,
        policy_adapter,
        reference_is_policy_base,
    )

    try:
        placed = placements(cfg)
        adapter = policy_adapter(cfg)
    except (KeyError, ValidationError):
        _options(cfg.policy.train, "train", "policy.train")  # raises the section's own error
        raise
    shape = model_shape(cfg.policy.model)
    work = _workload(cfg, prompt_tokens)
    anchors = {n: _anchor(n, placed) for n in placed}
    lora = _adapter_params(cfg, adapter) if adapter is not None else None
    p = cfg.policy
    handles = [Handle("policy", shape, p.resources.ranks, p.resources.gpus_per_rank, anchors["policy"],
                      trainer=_trainer(p.train, "policy.train", "causal_lm", p.resources.ranks, lora, shape))]
    gres = generator_resources(cfg)
    sync_adapter = adapter is not None and adapter.sync == "adapter"
    handles.append(Handle("rollout", shape, gres.ranks, gres.gpus_per_rank, anchors["rollout"],
                          generator=_generator(cfg, shape, work, 4 * lora if sync_adapter else 0)))
    if cfg.critic is not None:
        c = cfg.critic
        cshape = model_shape(c.model) if c.model else shape
        handles.append(Handle("critic", cshape, c.resources.ranks, c.resources.gpus_per_rank, anchors["critic"],
                              trainer=_trainer(c.train, "critic.train", "value", c.resources.ranks, None, cshape)))
    if cfg.reference is not None and not reference_is_policy_base(cfg):
        r = cfg.reference
        rshape = model_shape(r.model) if r.model else shape
        handles.append(Handle("reference", rshape, r.resources.ranks, r.resources.gpus_per_rank,
                              anchors["reference"], frozen=_frozen(r.infer, "reference.infer", "causal_lm",
                                                                   r.resources.ranks, rshape)))
    if cfg.reward.source == "model":
        w = cfg.reward
        wshape = model_shape(w.model)
        handles.append(Handle("reward", wshape, w.resources.ranks, w.resources.gpus_per_rank, anchors["reward"],
                              frozen=_frozen(w.infer, "reward.infer", "score", w.resources.ranks, wshape)))
    if cfg.teacher is not None:  # distillation: a frozen model scoring the student's tokens
        t = cfg.teacher
        tshape = model_shape(t.model)
        handles.append(Handle("teacher", tshape, t.resources.ranks, t.resources.gpus_per_rank, anchors["teacher"],
                              frozen=_frozen(t.infer, "teacher.infer", "causal_lm", t.resources.ranks, tshape)))
    notes = (f"prompts assumed {prompt_tokens} tokens (--prompt-tokens)",)
    return PlanInput(tuple(handles), work, cfg.rollout.max_staleness, p.weight_sync.transport,
                     p.weight_sync.bucket_mb << 20, notes)


def _anchor(name: str, placed: dict[str, Any]) -> str:
    from xrlhf.coordinator.spec import anchor_of

    return anchor_of(name, placed)


def _adapter_params(cfg: XConfig, adapter) -> int:
    from xrlhf.engines.lora import adapter_params

    return adapter_params(cfg.policy.model, "causal_lm", adapter)
