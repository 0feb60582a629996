"""``hf.train``: plain PyTorch training of a Transformers model with AdamW.

The train step's loop is ``TrainEngine``'s template; this engine gives it ``backward`` and
``optimizer_step``, and the model's I/O (weights out, HF-format saves, exact-resume state).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from xrlhf.config.schema import yaml_path
from xrlhf.data.batch import Batch
from xrlhf.engines.base import ENGINES, EngineSpec, ForwardOutput, TrainEngine
from xrlhf.engines.hf.model import HFModel, HFModelOptions
from xrlhf.engines.lora import LoraModel, LoraTraining, LoraTrainOptions, apply_lora
from xrlhf.engines.model_files import save_with_tokenizer
from xrlhf.engines.training import all_reduce_grads, lr_lambda


class HFTrainOptions(LoraTrainOptions, HFModelOptions):
    """``<handle>.train`` of the Transformers and DeepSpeed train engines: the shared train
    fields plus ``HFModelOptions``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mixed_precision: bool | None = Field(
        None, description="with dtype bfloat16: fp32 master weights, gradients and AdamW states, the forward in "
        "bf16 under autocast (true), or bf16 weights and optimizer states (false: half the memory of the states, "
        "updates below bf16's precision round away); default: true on a GPU, false on CPU (DeepSpeed's bf16 mode "
        "always keeps fp32 masters)")

    @model_validator(mode="after")
    def _compile_without_checkpointing(self, info: ValidationInfo):
        if self.compile and self.gradient_checkpointing:
            raise ValueError(f"{yaml_path(info, 'train')}.compile: the layers of gradient_checkpointing run eagerly "
                             f"in training (torch.compile does not trace through transformers' checkpointing); set "
                             f"one of compile, gradient_checkpointing to false")
        return self

    def uses_mixed_precision(self, device: str) -> bool:
        """Whether the engine trains fp32 masters under bf16 autocast on ``device``."""
        if self.dtype != "bfloat16":
            return False
        return self.mixed_precision if self.mixed_precision is not None else device.startswith("cuda")


@ENGINES.register("hf.train")
class HFTrainEngine(LoraTraining, TrainEngine):
    """Plain PyTorch training of a Transformers model (AdamW); data parallel through
    torch.distributed (gradients summed in one flat all-reduce per dtype). With ``lora`` set,
    PEFT adapters train and the base stays frozen (``xrlhf.engines.lora``)."""

    Options = HFTrainOptions

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        spec.dist.init_process_group()
        o = self.options
        self.mixed_precision = o.uses_mixed_precision(spec.device)
        lora = self.adapter_options(o)
        self.hf = HFModel(self.spec, keep_dropout=o.dropout, autocast=torch.bfloat16 if self.mixed_precision else None,
                          fp32_weights=lora is None)
        self.lora: LoraModel | None = None
        if lora is not None:
            self.hf.model = apply_lora(self.hf.model, lora, o.gradient_checkpointing)
            self.lora = LoraModel(self.hf.model, lora)
        self.model = self.hf.model
        self.device = self.hf.device
        if o.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.lr_warmup_steps, spec.total_steps, o.lr_schedule))
        self._broadcast_initial_weights()
        self.hf.prepare()

    @property
    def packed(self) -> bool:
        return self.hf.attention_path != "padded"

    def _broadcast_initial_weights(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for t in self.model.state_dict().values():
                dist.broadcast(t, src=0)

    def forward(self, batch: Batch, need_entropy: bool = False) -> ForwardOutput:
        return self.hf.forward(batch, need_entropy)

    def infer(self, batch: Batch) -> Batch:
        self.model.eval()
        try:
            return super().infer(batch)
        finally:
            self.model.train()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def optimizer_step(self) -> dict[str, float]:
        all_reduce_grads(self.params)
        clip = self.options.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip else float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        if torch.isfinite(norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "lr": lr, "skipped": float(not torch.isfinite(norm))}

    def _state_items(self, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
        return ((k, v) for k, v in self.model.state_dict().items() if keep is None or keep(k))

    def _save_full(self, path: str) -> None:
        if self.spec.dist.rank == 0:  # every rank is called (sharded engines gather); rank 0 writes
            save_with_tokenizer(self.model, self.spec.model_path, path)

    def state_dict(self) -> dict[str, Any]:
        """Model (with LoRA: the trainable tensors only), optimizer and scheduler state."""
        model = self.model.state_dict()
        if self.lora is not None:
            return {"model": self.lora.trainable_state(model), "lora_base": self.lora.base_fingerprint(),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        return {"model": {k: v.detach().cpu().clone() for k, v in model.items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.lora is not None:
            self.lora.check_base(state.get("lora_base"))
            self.lora.load_trainable_state(state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

