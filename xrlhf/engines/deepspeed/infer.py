"""``deepspeed.infer``: a frozen model (reference, reward) under DeepSpeed, replicated or ZeRO-3
partitioned across the handle's ranks."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel

from xrlhf.data.batch import Batch
from xrlhf.engines.base import ENGINES, EngineSpec, ForwardOutput, InferEngine
from xrlhf.engines.deepspeed.options import DeepSpeedInferOptions
from xrlhf.engines.deepspeed.zero import ZeroModel


@ENGINES.register("deepspeed.infer")
class DeepSpeedInferEngine(InferEngine):
    """A frozen model (reference, reward) under DeepSpeed: replicated (``zero_stage`` 0, the
    default) or partitioned across the handle's ranks (``zero_stage: 3``, optionally with
    ``offload_params``), without an optimizer. Under ZeRO-3 ``infer`` is a collective: every
    rank runs the same number of micro-batches (the handle splits batches evenly).
    Options: ``DeepSpeedInferOptions``; ``zero``: the ``ZeroModel``."""

    Options = DeepSpeedInferOptions
    requires = ("deepspeed",)
    pip_extra = "deepspeed"
    memory_model = "zero"  # Engine.memory_model: ZeRO partitions by zero_stage

    @classmethod
    def shard_stage(cls, options: BaseModel) -> int:
        """``zero_stage`` (``Engine.shard_stage``)."""
        return options.zero_stage

    @classmethod
    def sharding_options(cls, stage: int, offload: bool = False) -> dict[str, Any] | None:
        """ZeRO 0 or 3 (no optimizer to partition, nor to offload)."""
        return {"zero_stage": stage} if stage in (0, 3) and not offload else None

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        self.zero = ZeroModel(self.spec, self.options, "infer")
        self.device = self.zero.engine.device
        self.equal_micro_batches = self.zero.equal_micro_batches(training=False)
        self.zero.engine.eval()
        self.zero.module.requires_grad_(False)

    @property
    def packed(self) -> bool:
        return self.zero.hf.attention_path != "padded"

    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None) -> ForwardOutput:
        return self.zero.forward(batch, need_entropy, gather)

    def infer(self, batch: Batch) -> Batch:
        try:
            return super().infer(batch)
        finally:
            self.zero.release_gathered()
