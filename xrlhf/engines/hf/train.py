"""``hf.train``: plain PyTorch training of a Transformers model with AdamW.

The train step's loop is ``TrainEngine``'s template; this engine gives it ``backward`` and
``optimizer_step``, and the model's I/O (weights out, HF-format saves, exact-resume state).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from xrlhf.config.schema import yaml_path
from xrlhf.data.batch import Batch
from xrlhf.engines import lora as lora_part
from xrlhf.engines.base import ENGINES, EngineSpec, ForwardOutput, TrainEngine, TrainOptions
from xrlhf.engines.hf.model import HFModel, HFModelOptions, build_imports
from xrlhf.engines.lora import LORA_FIELD, AdapterWeights, LoraModel, LoraOptions, apply_lora, dropout_errors
from xrlhf.engines.mixed_precision import MasterWeights
from xrlhf.engines.model_files import save_with_tokenizer
from xrlhf.engines.training import all_reduce_grads, lr_lambda


MIXED_PRECISION_FIELD = Field(
    None, description="with dtype bfloat16: bf16 weights for the forward and backward, fp32 master weights, "
    "gradient accumulation and AdamW states in the optimizer (true), or bf16 weights and optimizer states "
    "(false: pure bf16, updates below bf16's precision round away); default: true on a GPU, false on CPU "
    "(DeepSpeed's bf16 mode always keeps fp32 masters)")
"""``mixed_precision`` of the train options of a backend built on ``HFModel`` (``hf``, ``deepspeed``)."""


def train_errors(options: BaseModel, path: str) -> list[str]:
    """What is wrong with the train options of a backend built on ``HFModel`` (``path``: the
    section's YAML path): LoRA's dropout without the section's, compiled layers with checkpointing."""
    errors = dropout_errors(options, path)
    if options.compile and options.gradient_checkpointing:
        errors.append(f"{path}.compile: the layers of gradient_checkpointing run eagerly in training (torch.compile "
                      f"does not trace through transformers' checkpointing); set one of compile, "
                      f"gradient_checkpointing to false")
    return errors


class HFTrainOptions(TrainOptions, HFModelOptions):
    """``<handle>.train`` of the Transformers train engine: the shared train fields plus
    ``HFModelOptions``, LoRA and mixed precision."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    lora: LoraOptions | None = LORA_FIELD
    mixed_precision: bool | None = MIXED_PRECISION_FIELD

    @model_validator(mode="after")
    def _checks(self, info: ValidationInfo):
        if errors := train_errors(self, yaml_path(info, "train")):
            raise ValueError("\n".join(errors))
        return self

    def uses_mixed_precision(self, device: str) -> bool:
        """Whether the engine trains bf16 weights with fp32 masters on ``device``."""
        if self.dtype != "bfloat16":
            return False
        return self.mixed_precision if self.mixed_precision is not None else device.startswith("cuda")


@ENGINES.register("hf.train")
class HFTrainEngine(TrainEngine):
    """Plain PyTorch training of a Transformers model (AdamW); data parallel through
    torch.distributed (gradients summed in one flat all-reduce per dtype). With ``lora`` set,
    PEFT adapters train and the base stays frozen (``xrlhf.engines.lora``); ``weights``
    (``AdapterWeights``) says how the weights leave the engine either way.

    With mixed precision (``HFTrainOptions.uses_mixed_precision``) the trainable weights are bf16
    and ``masters`` (``engines.mixed_precision.MasterWeights``) holds their fp32 masters and
    gradients, which AdamW steps; otherwise ``masters`` is ``None`` and AdamW steps the weights.
    On a GPU AdamW is fused (one kernel per step).

    Attributes:
        params: the trainable parameters (the model's own: bf16 views under mixed precision).
        param_names: their names, in the same order.
        lora: the ``LoraModel`` of the adapters, or ``None`` (every weight trains).
        weights: the ``AdapterWeights`` that ``named_weights``, ``weights_for_sync``,
            ``save_pretrained`` and ``infer_base`` delegate to.
    """

    Options = HFTrainOptions

    fork_imports = staticmethod(build_imports)  # Engine.fork_imports
    adapter_options = staticmethod(lora_part.adapter_of)  # TrainEngine.adapter_options
    model_errors = staticmethod(lora_part.model_errors)  # TrainEngine.model_errors

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        spec.dist.init_process_group()
        o = self.options
        self.mixed_precision = o.uses_mixed_precision(spec.device)
        lora = self.adapter_options(o)
        # mixed precision starts its masters from the checkpoint's exact values: fp32 until they
        # exist (a LoRA base stays frozen in dtype; PEFT makes the adapters fp32)
        self.hf = HFModel(self.spec, keep_dropout=o.dropout,
                          dtype=torch.float32 if self.mixed_precision and lora is None else None)
        self.lora: LoraModel | None = None
        if lora is not None:
            self.hf.model = apply_lora(self.hf.model, lora, o.gradient_checkpointing)
            self.lora = LoraModel(self.hf.model, lora)
        self.weights = AdapterWeights(self.lora, self._state_items, self._save_full, self.spec.model_path,
                                      writes=self.spec.dist.rank == 0)
        self.model = self.hf.model
        self.device = self.hf.device
        if o.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self._broadcast_initial_weights()
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.param_names, self.params = [n for n, _ in trainable], [p for _, p in trainable]
        self.masters = MasterWeights(self.params, torch.bfloat16) if self.mixed_precision else None
        fused = {"fused": True} if self.device.type == "cuda" else {}  # CPU keeps torch's default (the quickstart's numbers)
        self.optimizer = torch.optim.AdamW([self.masters.flat] if self.masters else self.params, lr=o.lr,
                                           betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.lr_warmup_steps, spec.total_steps, o.lr_schedule))
        self._log_precision()
        self.hf.prepare()

    def _log_precision(self) -> None:
        from loguru import logger

        n = sum(p.numel() for p in self.params)
        if self.masters is not None:
            logger.info(f"{self.spec.model_path}: mixed precision: {n:,} trained weights in bf16, their fp32 masters "
                        f"and gradients in one flat buffer each, AdamW{' (fused)' if self.device.type == 'cuda' else ''}"
                        f" on the masters")

    @property
    def packed(self) -> bool:
        return self.hf.attention_path != "padded"

    def _broadcast_initial_weights(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for t in self.model.state_dict().values():
                dist.broadcast(t, src=0)

    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None) -> ForwardOutput:
        return self.hf.forward(batch, need_entropy, gather)

    def derived_budget(self, infer: bool) -> int | None:
        """``HFModel.derived_budget``; a train budget counts the AdamW states (and, without mixed
        precision, the gradients) that the first optimizer step will still allocate."""
        if infer:
            return self.hf.derived_budget(training=False)
        return self.hf.derived_budget(training=True, pending_bytes=self._pending_bytes(),
                                      checkpointing=self.options.gradient_checkpointing)

    def _pending_bytes(self) -> int:
        stepped = [self.masters.flat] if self.masters is not None else self.params
        states = 0 if self.optimizer.state else sum(2 * p.numel() * p.element_size() for p in stepped)
        grads = sum(p.numel() * p.element_size() for p in self.params if p.grad is None) if self.masters is None else 0
        return states + grads

    def infer(self, batch: Batch) -> Batch:
        self.model.eval()
        try:
            return super().infer(batch)
        finally:
            self.model.train()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def optimizer_step(self) -> dict[str, float]:
        masters = self.masters
        if masters is not None:
            masters.all_reduce()
        else:
            all_reduce_grads(self.params)
        clip = self.options.grad_clip
        stepped = [masters.flat] if masters is not None else self.params
        norm = torch.nn.utils.clip_grad_norm_(stepped, clip if clip else float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        if torch.isfinite(norm):
            self.optimizer.step()
            if masters is not None:
                masters.publish()
        self.scheduler.step()
        if masters is not None:
            masters.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "lr": lr, "skipped": float(not torch.isfinite(norm))}

    def named_grads(self) -> dict[str, torch.Tensor]:
        """The accumulated gradient of each trainable weight by name (fp32 under mixed precision;
        ``None`` where none was computed), until ``optimizer_step`` clears them (tests, debugging)."""
        if self.masters is not None:
            return self.masters.named_grads(self.param_names)
        return {n: p.grad for n, p in zip(self.param_names, self.params)}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.weights.named()

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.weights.for_sync()

    def save_pretrained(self, path: str) -> None:
        self.weights.save(path)

    def infer_base(self, batch: Batch) -> Batch:
        with self.weights.base():
            return self.infer(batch)

    def _state_items(self, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
        return ((k, v) for k, v in self.model.state_dict().items() if keep is None or keep(k))

    def _save_full(self, path: str) -> None:
        if self.spec.dist.rank == 0:  # every rank is called (sharded engines gather); rank 0 writes
            save_with_tokenizer(self.model, self.spec.model_path, path)

    def state_dict(self) -> dict[str, Any]:
        """Model (with LoRA: the trainable tensors only), optimizer and scheduler state; under
        mixed precision the fp32 masters too (the bf16 weights cannot give them back)."""
        model = self.model.state_dict()
        out: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.lora is not None:
            out.update(model=self.lora.trainable_state(model), lora_base=self.lora.base_fingerprint())
        else:
            out["model"] = {k: v.detach().cpu().clone() for k, v in model.items()}
        if self.masters is not None:
            out["masters"] = self.masters.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s state.

        Raises:
            ValueError: a checkpoint of another precision (masters missing, or present without
                mixed precision), or of another LoRA setting.
        """
        if (self.masters is not None) != ("masters" in state):
            raise ValueError(f"{self.spec.model_path}: the checkpoint was saved {'with' if 'masters' in state else 'without'}"
                             f" mixed precision's fp32 master weights; resume with the same mixed_precision and dtype")
        if self.lora is not None:
            self.lora.check_base(state.get("lora_base"))
            self.lora.load_trainable_state(state["model"])
        else:
            self.model.load_state_dict(state["model"])
        if self.masters is not None:
            self.masters.load_state_dict(state["masters"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

