"""What flows into and out of an engine: how it is built (``EngineSpec``, ``DistInfo``), what a
forward returns (``ForwardOutput``), the loss contract of a train step (``LossFn``), and how a
generator samples (``SamplingParams``, ``GenerationOutput``, ``RolloutPlan``).

Why a module apart from ``base``: these are plain data types that the coordinator, the
algorithms and every backend pass around; ``base`` holds the engines' behaviour (the abstract
classes, the train template, the registry) and imports them, so ``xrlhf.engines.base`` still
names all of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Protocol

import torch
from pydantic import BaseModel

from xrlhf.data.batch import Batch

Head = Literal["causal_lm", "value", "score"]
"""What the model computes: next-token logits, a value per token, or one score per sequence."""

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class DistInfo:
    """Where this engine sits in its data-parallel group."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    timeout_s: float | None = None
    """How long a collective waits for its peers before it fails (``None``: torch's default)."""

    def init_process_group(self) -> None:
        """Join the default torch.distributed group of this handle's ranks (idempotent)."""
        import datetime

        import torch.distributed as dist

        if self.world_size <= 1 or dist.is_initialized():
            return
        os.environ.setdefault("MASTER_ADDR", self.master_addr)
        os.environ.setdefault("MASTER_PORT", str(self.master_port))
        timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size,
                                init_method=f"tcp://{self.master_addr}:{self.master_port}", timeout=timeout)


@dataclass
class EngineSpec:
    """Everything an engine needs to build itself; made by the coordinator from YAML.

    Args:
        model_path: a local HF-format directory.
        head: what the model computes (see ``Head``).
        device: ``"cpu"`` or ``"cuda"`` (the worker's visible GPU).
        options: the engine's ``Options`` (the YAML section validated by the engine class), or
            a dict the engine validates into them when it is built (direct use, tests).
        dist: the data-parallel group.
        seed: the base seed; engines offset it by rank where sampling must differ.
        temperature: the sampling temperature logprobs are computed at (train / infer engines).
        total_steps: optimizer steps the run will take (LR schedules of train engines).
        adapter: a generate engine's: the LoRA adapter (``engines.lora.LoraOptions`` with
            ``sync: adapter``) its weight syncs carry instead of full weights; ``None``: full weights.
        cache_dir: a directory of the run for caches that outlive a worker (``compile: true``:
            inductor's under ``torchinductor/``); ``None``: the libraries' own defaults
            (inductor: ``/tmp/torchinductor_<user>``).
        memory_share: the part of the GPU's free memory a token budget derived for this engine
            (``engines.budget``) may plan for: 1 alone; ``1 / k`` where ``k`` handles share the
            GPU and train at the same time (PPO's policy and critic, co-located).
    """

    model_path: str
    head: Head = "causal_lm"
    device: str = "cpu"
    options: BaseModel | dict[str, Any] = field(default_factory=dict)
    dist: DistInfo = field(default_factory=DistInfo)
    seed: int = 0
    temperature: float = 1.0
    total_steps: int = 0
    adapter: BaseModel | None = None
    cache_dir: str | None = None
    memory_share: float = 1.0


@dataclass
class ForwardOutput:
    """What a train/infer forward returns for the response part of a batch.

    Attributes:
        logprobs: ``[B, R]`` logprob of each response token (causal LM head), else ``None``.
        entropy: ``[B, R]`` entropy of the next-token distribution, when asked for.
        values: ``[B, R]`` value of the state before each response token (value head).
        scores: ``[B]`` one score per sequence (score head).
        gathered: ``[B, R, k]`` logprobs of the ids a forward was asked to gather at each
            response position (``gather``: a teacher's top-k ids), differentiable.
        topk_logprobs, topk_ids: ``[B, R, k]`` each position's ``k`` most likely tokens and their
            logprobs (an infer engine's ``topk_logprobs`` option: a top-k distillation teacher).
    """

    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None


class LossFn(Protocol):
    """A loss given to ``TrainEngine.train_step``; built by an algorithm from pure functions.

    ``__call__`` returns the *sum* of the loss over the micro-batch's units and metrics
    (each a mean over the micro-batch). The engine divides by the number of units in the
    whole global mini-batch (all ranks), so gradients do not depend on how the batch was
    split across ranks and micro-batches.

    Attributes:
        unit: ``"token"`` (units are ``response_mask`` ones) or ``"sequence"`` (rows).
        needs_entropy: whether the forward must compute the entropy.
        gather_key (optional, default none): a batch key of ``[B, R, k]`` token ids whose logprobs
            the forward must also return (``ForwardOutput.gathered``).
        row_weighted: a sequence-unit loss that leaves out the rows whose ``row_weight`` ``[B]``
            is 0 (padding copies a data-parallel split adds; ``data.dispatch``), so a batch its
            ranks do not divide can be padded. The engines count ``row_weight``'s sum as the rows.
        rows_per_group (optional, default 1): consecutive rows a micro-batch must keep together
            (2 for losses on interleaved chosen / rejected pairs).
    """

    unit: Literal["token", "sequence"]
    needs_entropy: bool
    row_weighted: bool

    def __call__(self, out: ForwardOutput, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass
class SamplingParams:
    """How a generate engine samples; the same fields for every backend.

    ``temperature == 0`` means greedy. ``logprobs`` returned are of the temperature-scaled
    distribution before top-p/top-k truncation: the distribution the trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    on_update: Literal["continue", "recompute", "abort"] = "continue"
    """What a call does with its unfinished rows when new weights land while it runs (engines
    that ``pauses_mid_generation``): ``continue`` keeps their KV cache (computed by the old
    weights) and samples on with the new ones; ``recompute`` recomputes the KV cache of the
    tokens so far with the new weights first; ``abort`` restarts the rows from the prompt, so
    every token of a row comes from one version."""
    in_flight: bool = False
    """Weights may land while this call runs (``rollout.in_flight_updates``). Only then must an
    engine follow each token's version as it is sampled (vLLM: per-step outputs, which cost host
    time on every step); otherwise a row that sees an update mid-call is restarted."""
    logprobs: bool = True
    """Return each sampled token's logprob. ``False``: the engine need not compute or move them
    (vLLM's per-token logprob outputs cost ~30% of its throughput on a small model) and
    ``GenerationOutput.logprobs`` is ``[]``."""


@dataclass
class GenerationOutput:
    """Generated continuations: ``B`` lists of token ids, their sampling logprobs and the
    policy version (``GenerateEngine.version``) that sampled each token."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    """``B`` lists like ``token_ids``; ``[]`` (no rows at all, whatever ``B``) when the call asked for
    none (``SamplingParams.logprobs=False``), for every engine: a consumer that reads them anyway
    fails at once instead of reading numbers no sampler produced."""
    versions: list[list[int]] = field(default_factory=list)
    """``B`` lists like ``token_ids``; empty when the engine does not stamp versions."""


@dataclass(frozen=True)
class RolloutPlan:
    """What a generate engine's ``rollout_errors`` may check against.

    Attributes:
        split: the generators have their own devices (``policy.generate.resources``).
        device_gib: total memory of the GPU the co-located policy worker will use, when the
            validating process can see one (else ``None``: memory is not checked).
        trainer_gib: the estimated peak of the training engines sharing that GPU
            (``engines.training.estimate_train_gib``), ``None`` when not estimated.
    """

    split: bool
    device_gib: float | None = None
    trainer_gib: float | None = None

