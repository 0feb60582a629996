"""``deepspeed.train``: training with DeepSpeed ZeRO stage 0-3, optionally with CPU offload.

How the ``LossFn`` contract maps onto DeepSpeed (see ``TrainEngine.train_step``):

* the loss is a *sum* over units divided by the global unit count (all ranks), exactly as in
  ``HFTrainEngine``; DeepSpeed *averages* gradients over the data-parallel ranks where
  ``HFTrainEngine`` sums them, so the loss is also multiplied by the DP world size (exact in
  fp32 for power-of-two world sizes). Then the update does not depend on how the global batch
  was split over ranks and micro-batches;
* one optimizer step per ``train_step`` whatever the micro-batch count:
  ``gradient_accumulation_steps`` is 1 and the accumulation boundary is set by hand on the
  last micro-batch (``set_gradient_accumulation_boundary``), with ``backward(scale_wrt_gas=False)``;
* clipping is DeepSpeed's ``gradient_clipping`` (from ``grad_clip``); the LR schedule is a
  ``LambdaLR`` over ``lr_lambda`` handed to ``deepspeed.initialize``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from pydantic import BaseModel

from xrlhf.data.batch import Batch
from xrlhf.engines import lora as lora_part
from xrlhf.engines.base import ENGINES, EngineSpec, ForwardOutput, TrainEngine
from xrlhf.engines.deepspeed.options import DeepSpeedTrainOptions
from xrlhf.engines.deepspeed.zero import ZeroModel
from xrlhf.engines.lora import AdapterWeights
from xrlhf.engines.training import lr_lambda


@ENGINES.register("deepspeed.train")
class DeepSpeedTrainEngine(TrainEngine):
    """Training with DeepSpeed ZeRO stage 0-3, optional optimizer / parameter CPU offload.
    Options: ``DeepSpeedTrainOptions``.

    Attributes:
        zero: the ``ZeroModel`` (the DeepSpeed engine, its module, the forward, the gathers).
        weights: the ``AdapterWeights`` that ``named_weights``, ``weights_for_sync``,
            ``save_pretrained`` and ``infer_base`` delegate to (LoRA or not).
    """

    Options = DeepSpeedTrainOptions
    requires = ("deepspeed",)
    pip_extra = "deepspeed"
    memory_model = "zero"  # Engine.memory_model: ZeRO partitions by zero_stage
    adapter_options = staticmethod(lora_part.adapter_of)  # TrainEngine.adapter_options
    model_errors = staticmethod(lora_part.model_errors)  # TrainEngine.model_errors

    @classmethod
    def shard_stage(cls, options: BaseModel) -> int:
        """``zero_stage`` (``Engine.shard_stage``)."""
        return options.zero_stage

    @classmethod
    def sharding_options(cls, stage: int, offload: bool = False) -> dict[str, Any] | None:
        """ZeRO ``stage``; optimizer offload from stage 1."""
        return {"zero_stage": stage, **({"offload_optimizer": True} if offload and stage else {})}

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        o = self.options
        schedule = lr_lambda(o.lr_warmup_steps, spec.total_steps, o.lr_schedule)
        self.zero = ZeroModel(self.spec, o, "train", self.adapter_options(o),
                              lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        self.weights = AdapterWeights(self.zero.lora, self.zero.state_items, self.zero.save_full,
                                      self.spec.model_path, writes=self.spec.dist.rank == 0)
        self.device = self.zero.engine.device
        self.equal_micro_batches = self.zero.equal_micro_batches(training=True)
        self.collective_weights = self.zero.zero_stage == 3
        self.zero.engine.train()
        self.dp_world_size = dist.get_world_size()

    @property
    def packed(self) -> bool:
        return self.zero.hf.attention_path != "padded"

    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None) -> ForwardOutput:
        return self.zero.forward(batch, need_entropy, gather)

    def infer(self, batch: Batch) -> Batch:
        self.zero.engine.eval()
        try:
            return super().infer(batch)
        finally:
            self.zero.release_gathered()
            self.zero.engine.train()

    def infer_base(self, batch: Batch) -> Batch:
        with self.weights.base():
            return self.infer(batch)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.weights.named()

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.weights.for_sync()

    def save_pretrained(self, path: str) -> None:
        self.weights.save(path)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.zero.engine.set_gradient_accumulation_boundary(last)
        # DeepSpeed averages gradients over DP ranks; the contract wants their sum.
        self.zero.engine.backward(loss * self.dp_world_size, scale_wrt_gas=False)

    def optimizer_step(self) -> dict[str, float]:
        lr = self.zero.engine.get_lr()[0]
        norm = self._grad_norm_stage0() if self.zero.zero_stage == 0 else None
        self.zero.engine.step()
        if norm is None:
            norm = self.zero.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return {"grad_norm": norm, "lr": lr, "skipped": float(not self.zero.engine.was_step_applied())}

    def _grad_norm_stage0(self) -> float:
        """ZeRO-0 keeps no norm: the all-reduced gradients' 2-norm, before clipping."""
        grads = [p.grad.detach().float() for p in self.zero.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0

    def state_dict(self) -> dict[str, Any]:
        """This rank's share of a DeepSpeed checkpoint (a collective: every rank calls it).

        Returns ``{"format": "deepspeed", "world_size": n, "shard_files": {relative path: bytes}}``
        with the files ``engine.save_checkpoint`` wrote on this rank (model, optimizer shard,
        scheduler). ``load_state_dict`` needs the union of every rank's files:
        ``xrlhf.engines.training.merge_rank_states`` (what ``ModelHandle.state_dict`` returns).
        """
        tmp = Path(tempfile.mkdtemp(prefix="xrlhf-ds-ckpt-"))
        try:
            dist.barrier()
            # with LoRA the frozen base is not state: it comes back from the model directory
            lora = {} if self.zero.lora is None else {"lora_base": self.zero.lora.base_fingerprint()}
            self.zero.engine.save_checkpoint(str(tmp), tag="state", client_state=lora,
                                        exclude_frozen_parameters=self.zero.lora is not None)
            dist.barrier()
            files = {str(f.relative_to(tmp)): f.read_bytes() for f in sorted(tmp.rglob("*")) if f.is_file()}
            dist.barrier()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"format": "deepspeed", "world_size": dist.get_world_size(), "shard_files": files}

    def save_state(self, path: str) -> None:
        """Every rank writes its own shard files with ``engine.save_checkpoint`` into ``path``
        (a collective; no shard bytes leave the rank), rank 0 the world size beside them."""
        os.makedirs(path, exist_ok=True)
        dist.barrier()
        self.zero.engine.save_checkpoint(path, tag="state", client_state={})
        if dist.get_rank() == 0:
            Path(path, "xrlhf_world_size").write_text(str(dist.get_world_size()))
        dist.barrier()

    def load_state(self, path: str) -> None:
        """Every rank loads its shards of what ``save_state`` wrote (a collective).

        Raises:
            ValueError: for a checkpoint of another data-parallel world size, or none at all.
        """
        saved = Path(path, "xrlhf_world_size")
        if saved.is_file() and int(saved.read_text()) != dist.get_world_size():
            raise ValueError(f"DeepSpeedTrainEngine.load_state: {path} was saved with {saved.read_text()} ranks, "
                             f"loading on {dist.get_world_size()}")
        loaded, _ = self.zero.engine.load_checkpoint(path, tag="state")
        if loaded is None:
            raise ValueError(f"DeepSpeedTrainEngine.load_state: DeepSpeed found no checkpoint in {path}")
        dist.barrier()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``merge_rank_states`` of every rank's ``state_dict`` (a collective).

        Raises:
            ValueError: for a state that is not a DeepSpeed checkpoint of this DP world size.
        """
        if state.get("format") != "deepspeed":
            raise ValueError("DeepSpeedTrainEngine.load_state_dict: not a DeepSpeed state (from state_dict)")
        if state.get("world_size") != dist.get_world_size():
            raise ValueError(f"DeepSpeedTrainEngine.load_state_dict: saved with {state.get('world_size')} ranks, "
                             f"loading on {dist.get_world_size()}")
        tmp = Path(tempfile.mkdtemp(prefix="xrlhf-ds-load-"))
        try:
            for rel, data in state["shard_files"].items():
                f = tmp / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(data)
            path, client = self.zero.engine.load_checkpoint(str(tmp), tag="state",
                                                            load_module_strict=self.zero.lora is None)
            if path is None:
                raise ValueError("DeepSpeedTrainEngine.load_state_dict: DeepSpeed found no checkpoint in the state")
            dist.barrier()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.zero.lora is not None:  # the frozen base is not in the files: it must be the one they were made on
            self.zero.lora.check_base((client or {}).get("lora_base"))
