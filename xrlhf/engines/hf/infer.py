"""``hf.infer``: logprobs, values or scores with a frozen Transformers model (a reference, a
reward model)."""

from __future__ import annotations

import torch
from pydantic import ConfigDict, Field

from xrlhf.data.batch import Batch
from xrlhf.engines.base import ENGINES, EngineSpec, ForwardOutput, InferEngine, InferOptions
from xrlhf.engines.hf.model import HFModel, HFModelOptions, build_imports


TOPK_FIELD = Field(0, ge=0, description="also return each response position's k most likely tokens and their "
                   "logprobs (topk_ids, topk_logprobs [B, R, k]): a teacher for top-k distillation "
                   "(algorithm.topk_coef); 0: none")
"""``topk_logprobs`` of the infer options of a backend built on ``HFModel`` (``hf``, ``deepspeed``)."""


class HFInferOptions(InferOptions, HFModelOptions):
    """``<handle>.infer`` of the Transformers infer engine."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    topk_logprobs: int = TOPK_FIELD


@ENGINES.register("hf.infer")
class HFInferEngine(InferEngine):
    """Logprobs, values or scores with a frozen Transformers model."""

    Options = HFInferOptions

    fork_imports = staticmethod(build_imports)  # Engine.fork_imports

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        self.hf = HFModel(self.spec)
        self.hf.model.eval().requires_grad_(False)
        self.device = self.hf.device
        self.hf.prepare()

    @property
    def packed(self) -> bool:
        return self.hf.attention_path != "padded"

    def derived_budget(self, infer: bool) -> int | None:
        return self.hf.derived_budget(training=False)

    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None) -> ForwardOutput:
        return self.hf.forward(batch, need_entropy, gather)
