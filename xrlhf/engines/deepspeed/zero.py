"""``ZeroModel``: a Transformers model under a DeepSpeed engine, the part both DeepSpeed engines hold.

Loading and placing the model (with LoRA's adapters wrapped in before DeepSpeed sees it), the
forward (``HFModel``'s), and the weights out of any ZeRO stage: under ZeRO-3 gathered a bucket
of at most ``gather_bucket_mb`` at a time, copied and released before the next, so the full
model is never materialised on the accelerator at once.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from loguru import logger
from pydantic import BaseModel

from xrlhf.data.batch import Batch
from xrlhf.engines.base import EngineSpec, ForwardOutput
from xrlhf.engines.deepspeed.options import merged_config
from xrlhf.engines.hf.model import HFModel
from xrlhf.engines.lora import LoraModel, LoraOptions, apply_lora
from xrlhf.engines.model_files import save_with_tokenizer


def init_distributed(spec: EngineSpec) -> None:
    """Join the DP group (a one-rank group when alone) and tell DeepSpeed about it.

    DeepSpeed needs a process group and ``LOCAL_RANK`` even for one rank. Each Ray worker sees
    only its own GPU, so the local device index is that of ``spec.device`` (0 by default).
    """
    import deepspeed

    device = torch.device(spec.device)
    os.environ["LOCAL_RANK"] = str(device.index or 0)  # DeepSpeed places the engine by it
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # before NCCL picks a device for this rank
    if device.type == "cpu":
        # DeepSpeed would JIT-compile (minutes of g++) a shared-memory all-reduce that only its
        # inference all-reduce uses; gloo does everything training needs.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        if spec.dist.world_size > 1:
            spec.dist.init_process_group()
        else:
            dist.init_process_group(spec.dist.backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)


def _load(spec: EngineSpec, keep_dropout: bool) -> HFModel:
    """``HFModel`` loaded in CPU memory: ``deepspeed.initialize`` places (or partitions) it."""
    hf = HFModel(dataclasses.replace(spec, device="cpu"), keep_dropout)
    hf.spec = spec
    return hf


def _is_zero3_param(t: torch.Tensor) -> bool:
    return hasattr(t, "ds_id")


def gathered_weights(module: torch.nn.Module, bucket_bytes: int, stats: dict[str, int] | None = None,
                     keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s state dict in HF naming, ZeRO-3 parameters gathered a bucket at a time
    (only the entries whose key ``keep`` accepts, when given: a LoRA adapter's tensors).

    Collective under ZeRO-3: every rank must iterate it to the end, in step. Tensors are
    cloned (on the accelerator) before their bucket is released, so a consumer may keep them.
    ``stats`` (optional) receives ``buckets`` and ``peak_gathered_bytes``: the largest number
    of bytes of full ZeRO-3 parameters materialised at once, read from their ZeRO status.
    """
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    items = [(k, v) for k, v in module.state_dict(keep_vars=True).items() if keep is None or keep(k)]
    zero3 = list({id(p): p for _, p in items if _is_zero3_param(p)}.values())  # tied weights once
    stats = stats if stats is not None else {}
    stats.setdefault("buckets", 0)
    stats.setdefault("peak_gathered_bytes", 0)
    i = 0
    while i < len(items):
        group: list[tuple[str, torch.Tensor]] = []
        size = 0
        while i < len(items):
            name, t = items[i]
            nbytes = (t.ds_numel if _is_zero3_param(t) else t.numel()) * t.element_size()
            if group and size + nbytes > bucket_bytes:
                break
            group.append((name, t))
            size += nbytes
            i += 1
        params = list({id(t): t for _, t in group if _is_zero3_param(t)}.values())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
            live = sum(p.ds_numel * p.element_size() for p in zero3 if p.ds_status == ZeroParamStatus.AVAILABLE)
            stats["peak_gathered_bytes"] = max(stats["peak_gathered_bytes"], live)
            out = [(name, t.detach().clone()) for name, t in group]
        stats["buckets"] += 1
        yield from out


def _cpu_adam_or_torch(config: dict[str, Any]) -> None:
    """With the optimizer offloaded, DeepSpeed's CPU Adam is JIT-compiled (a C++ compiler and
    the Python headers are needed). Where it cannot be built, fall back to torch's AdamW on the
    CPU shards (slower, same update) and say so, rather than fail the run."""
    params = config["optimizer"]["params"]
    if config["zero_optimization"]["offload_optimizer"]["device"] != "cpu" or params.get("torch_adam"):
        return
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    except Exception as e:  # noqa: BLE001 - any build failure means: use torch's Adam
        logger.warning(f"DeepSpeed CPU Adam unavailable ({type(e).__name__}: {str(e)[:200]}); "
                       "the offloaded optimizer uses torch.optim.AdamW instead")
        params["torch_adam"] = True
        config["zero_force_ds_cpu_optimizer"] = False


class ZeroModel:
    """The model under a DeepSpeed engine, for one role (``"train"`` or ``"infer"``).

    Args:
        spec: the engine's spec (its options validated).
        options: the engine's options (``DeepSpeedTrainOptions`` / ``DeepSpeedInferOptions``).
        role: ``"train"`` (an optimizer; dropout and checkpointing as the options say) or ``"infer"``.
        lora: the adapter to train (``LoraOptions``), wrapped in before DeepSpeed sees the
            model, so that only the adapters reach its optimizer; ``None``: every weight.
        init_kwargs: passed on to ``deepspeed.initialize`` (the train engine's LR scheduler).

    Attributes:
        engine: the ``DeepSpeedEngine``; ``module`` the model it wraps; ``hf`` the ``HFModel``
            whose forward runs through the engine (the ZeRO-3 gather hooks).
        zero_stage, ds_config: the ZeRO stage and the merged DeepSpeed config.
        lora: the adapters' ``LoraModel``, or ``None``.
        gather_stats: the last ZeRO-3 gather's ``buckets`` and ``peak_gathered_bytes``.
    """

    def __init__(self, spec: EngineSpec, options: BaseModel, role: str, lora: LoraOptions | None = None,
                 **init_kwargs):
        import deepspeed

        init_distributed(spec)
        self.ds_config = merged_config(options, role)
        if role == "train":
            _cpu_adam_or_torch(self.ds_config)
        self.zero_stage = int(self.ds_config["zero_optimization"]["stage"])
        self.hf = _load(spec, keep_dropout=role == "train" and options.dropout)
        if lora is not None:  # before DeepSpeed sees the model: only the adapters reach its optimizer
            self.hf.model = apply_lora(self.hf.model, lora, options.gradient_checkpointing)
            init_kwargs["model_parameters"] = [p for p in self.hf.model.parameters() if p.requires_grad]
        if role == "train" and options.gradient_checkpointing:
            self.hf.model.gradient_checkpointing_enable()
        self.engine, *_ = deepspeed.initialize(model=self.hf.model, config=self.ds_config, **init_kwargs)
        self.hf.model = self.engine  # the engine's forward runs the ZeRO-3 gather hooks
        self.hf.device = self.engine.device
        self.module: torch.nn.Module = self.engine.module
        self.lora = LoraModel(self.module, lora) if lora is not None else None
        self.model_path = spec.model_path
        bucket_mb = getattr(options, "gather_bucket_mb", None)  # train options only: inference hands no weights out
        self.gather_bucket_bytes = int(bucket_mb * (1 << 20)) if bucket_mb else None
        self.gather_stats: dict[str, int] = {}
        self.hf.prepare()  # after placement: the probe runs where the engine will (a collective under ZeRO-3)

    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None) -> ForwardOutput:
        return self.hf.forward(batch, need_entropy, gather)

    def release_gathered(self) -> None:
        """ZeRO-3 keeps parameters gathered after a no-grad forward (they are "reused soon"
        within ``stage3_max_reuse_distance``); give them back so inference does not end
        holding the whole model. No-op below stage 3."""
        if self.zero_stage == 3:
            self.engine.empty_partition_cache()

    def equal_micro_batches(self, training: bool) -> bool:
        """Whether every rank must run as many micro-batches (``InferEngine.equal_micro_batches``):
        ZeRO-3 gathers parameters in every forward; ZeRO-2 and 3 reduce gradients in every
        backward (stage 0 and 1 only at the accumulation boundary, once per step)."""
        return self.zero_stage == 3 or (training and self.zero_stage == 2)

    def state_items(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's state-dict pairs (those whose key ``keep`` accepts). ZeRO 0-2: as they
        are; ZeRO-3: gathered bucket by bucket (a collective: every rank must consume the
        iterator to the end)."""
        if self.zero_stage < 3:
            yield from ((k, v) for k, v in self.module.state_dict().items() if keep is None or keep(k))
            return
        self.release_gathered()
        self.gather_stats = {}
        yield from gathered_weights(self.module, self.gather_bucket_bytes, self.gather_stats, keep)

    def save_full(self, path: str) -> None:
        """HF-format directory at ``path`` from any stage; called on every rank, rank 0 writes.

        Under ZeRO-3 every rank joins the bucket-by-bucket gather and rank 0 keeps a CPU copy.
        """
        rank = dist.get_rank()
        if self.zero_stage < 3:
            if rank == 0:
                save_with_tokenizer(self.module, self.model_path, path)
            return
        state = {}
        for name, t in self.state_items():
            if rank == 0:
                state[name] = t.cpu()
        if rank == 0:
            save_with_tokenizer(self.module, self.model_path, path, state_dict=state)
