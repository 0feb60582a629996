"""DeepSpeed backend: ZeRO 0-3 training (with CPU offload) and ZeRO-3 partitioned inference.

The model, its forward pass and the LR schedule are the Transformers backend's (``HFModel``,
``lr_lambda``); only the optimizer, the gradient reduction and the parameter layout change.
DeepSpeed is imported only inside the functions that build and run an engine, so validation
reads the options here (``DeepSpeedTrainOptions``, ``DeepSpeedInferOptions``) without DeepSpeed
installed, and a run with ``engine: hf`` never loads it.

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

ZeRO-3 weights leave the engine bucket by bucket (``named_weights``): a group of parameters of
at most ``gather_bucket_mb`` (option, default 256) is gathered, copied, and released
before the next, so the full model is never materialised on the accelerator at once.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping

import torch
import torch.distributed as dist
from loguru import logger
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from xrlhf.config.schema import yaml_path
from xrlhf.data.batch import Batch
from xrlhf.engines.base import ENGINES, EngineSpec, ForwardOutput, InferEngine, InferOptions, TrainEngine, TrainOptions
from xrlhf.engines.hf.infer import TOPK_FIELD
from xrlhf.engines.hf.model import HFModel, HFModelOptions
from xrlhf.engines.hf.train import MIXED_PRECISION_FIELD, train_errors
from xrlhf.engines.lora import LORA_FIELD, LoraModel, LoraOptions, LoraTraining, apply_lora
from xrlhf.engines.model_files import save_with_tokenizer
from xrlhf.engines.training import lr_lambda

# -- options: the engine's own YAML fields and the DeepSpeed config made from them ----------------
OWNED = {
    "train_batch_size": "the global batch is the algorithm's (algorithm.mini_batch_size)",
    "train_micro_batch_size_per_gpu": "set {p}.micro_batch_size instead",
    "gradient_accumulation_steps": "xrlhf steps once per mini-batch whatever the micro-batch count; "
                                   "set {p}.micro_batch_size instead",
    "optimizer": "set {p}.lr, betas, eps and weight_decay instead",
    "scheduler": "set {p}.lr_warmup_steps and lr_schedule instead",
}
"""Keys of the ``deepspeed:`` block that are always errors, with what to do instead."""

DERIVED = {
    "gradient_clipping": "grad_clip",
    "bf16.enabled": "dtype",
    "fp16.enabled": "dtype",
    "zero_optimization.stage": "zero_stage",
    "zero_optimization.offload_optimizer.device": "offload_optimizer",
    "zero_optimization.offload_param.device": "offload_params",
}
"""Keys of the generated config that come from a field of the section (dotted path -> field)."""

_QUIET = {"steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def _without_conflicts(o: BaseModel, info: ValidationInfo | None, role: str) -> BaseModel:
    """``o`` if its ``deepspeed:`` block has no conflicts, else every conflict in one error, each
    line named by the YAML path that validation passes in its context (``{"path": ...}``)."""
    path = yaml_path(info, "deepspeed engine")
    errors = conflicts(o, path, role)
    if errors:
        raise ValueError("\n".join(errors))
    return o


class DeepSpeedTrainOptions(TrainOptions, HFModelOptions):
    """``<handle>.train`` with ``engine: deepspeed``: the shared train fields, ``HFModelOptions``,
    LoRA and mixed precision as for ``hf`` (``HFTrainOptions``), plus these.

    A free ``deepspeed:`` block is merged over the config xrlhf generates from the section's
    fields; merging never overrides a value silently: keys xrlhf owns (``OWNED``) are always
    errors, keys generated from a field (``DERIVED``) are errors when the values differ.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    lora: LoraOptions | None = LORA_FIELD
    mixed_precision: bool | None = MIXED_PRECISION_FIELD
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage")
    offload_optimizer: bool = Field(False, description="optimizer states in CPU memory (ZeRO 1-3)")
    offload_params: bool = Field(False, description="parameters in CPU memory (ZeRO 3)")
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="extra DeepSpeed config keys, merged over "
                                      "the generated ones (conflicts are errors)")
    gather_bucket_mb: float = Field(256, gt=0, description="ZeRO-3: weights are gathered this many MB at a time")

    @model_validator(mode="after")
    def _conflicts(self, info: ValidationInfo):
        if errors := train_errors(self, yaml_path(info, "train")):
            raise ValueError("\n".join(errors))
        return _without_conflicts(self, info, "train")

    def compiles(self, device: str) -> bool:
        """Only where ``compile: true`` is set: compiled layers under DeepSpeed are not measured yet."""
        return bool(self.compile)


class DeepSpeedInferOptions(InferOptions, HFModelOptions):
    """``<handle>.infer`` with ``engine: deepspeed``: a frozen model, replicated or ZeRO-3 partitioned;
    the fields of ``HFInferOptions`` plus these."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    topk_logprobs: int = TOPK_FIELD
    zero_stage: Literal[0, 3] = Field(0, description="0 (replicated) or 3 (partitioned across the handle's ranks)")
    offload_params: bool = Field(False, description="parameters in CPU memory (ZeRO 3)")
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="extra DeepSpeed config keys")

    @model_validator(mode="after")
    def _conflicts(self, info: ValidationInfo):
        return _without_conflicts(self, info, "infer")

    def compiles(self, device: str) -> bool:
        """Only where ``compile: true`` is set (as for training)."""
        return bool(self.compile)


def _offload(flag: bool) -> dict[str, Any]:
    return {"device": "cpu" if flag else "none"}


def generated_train_config(o: DeepSpeedTrainOptions) -> dict[str, Any]:
    """The DeepSpeed config xrlhf derives from the train options ``o`` (without the user block).

    fp32 unless ``dtype: bfloat16`` (then DeepSpeed's bf16 mode: bf16 weights, fp32 master
    weights and optimizer states). The optimizer is torch's AdamW (no compiled op) unless the
    optimizer is offloaded, where DeepSpeed's CPU Adam is the point of offloading.
    """
    return {
        "train_micro_batch_size_per_gpu": o.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(o.grad_clip or 0.0),
        "optimizer": {"type": "AdamW", "params": {
            "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
            "torch_adam": not o.offload_optimizer}},
        "bf16": {"enabled": o.dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": o.zero_stage, "offload_optimizer": _offload(o.offload_optimizer),
                              "offload_param": _offload(o.offload_params)},
        "zero_allow_untested_optimizer": True,
        **_QUIET,
    }


def generated_infer_config(o: DeepSpeedInferOptions) -> dict[str, Any]:
    """The DeepSpeed config of a frozen model: no optimizer, ZeRO 0 or 3."""
    return {
        "train_micro_batch_size_per_gpu": o.micro_batch_size,
        "bf16": {"enabled": o.dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": o.zero_stage, "offload_param": _offload(o.offload_params)},
        **_QUIET,
    }


def _generated(o: BaseModel, role: str) -> dict[str, Any]:
    return generated_train_config(o) if role == "train" else generated_infer_config(o)


def _leaves(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out += _leaves(v, path + ".")
        else:
            out.append((path, v))
    return out


def _get(d: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, Mapping) or part not in d:
            return _MISSING
        d = d[part]
    return d


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return a == b


def conflicts(o: BaseModel, path: str, role: str = "train") -> list[str]:
    """Errors for the ``deepspeed:`` block of the options ``o`` found at YAML ``path``.

    Args:
        o: the section's options (``DeepSpeedTrainOptions`` / ``DeepSpeedInferOptions``).
        path: the section's YAML path, e.g. ``policy.train``.
        role: ``"train"`` or ``"infer"`` (an infer section owns fewer keys).

    Returns:
        one line per problem, each starting with the offending YAML path.
    """
    user = o.deepspeed
    ours = _generated(o, role)
    errors = []
    for key, advice in OWNED.items():
        if key in user:
            errors.append(f"{path}.deepspeed.{key}: set by xrlhf, not here; {advice.format(p=path)}")
    for leaf, value in _leaves(user):
        if leaf.split(".")[0] in OWNED:
            continue
        field = DERIVED.get(leaf)
        mine = _get(ours, leaf)
        if field is None or mine is _MISSING or _same(value, mine):
            continue
        if field == "dtype":
            hint = ("set it there (bfloat16 or float32); fp16 is not supported" if leaf.startswith("fp16")
                    else "set it there")
            errors.append(f"{path}.deepspeed.{leaf}: conflicts with {path}.dtype ({o.dtype!r}); {hint}")
        else:
            errors.append(f"{path}.deepspeed.{leaf}: {value!r} conflicts with {path}.{field} "
                          f"({getattr(o, field)!r}); set it there")
    stage = _get(ours, "zero_optimization.stage")
    if o.offload_params and stage != 3:
        errors.append(f"{path}.offload_params: parameter offload needs zero_stage 3, got {stage}")
    if role == "train" and o.offload_optimizer and stage == 0:
        errors.append(f"{path}.offload_optimizer: optimizer offload needs zero_stage 1, 2 or 3, got 0")
    if o.compile and stage == 3:
        other = 2 if role == "train" else 0
        errors.append(f"{path}.compile: ZeRO-3's hooks that gather each layer's weights break the compiled layers "
                      f"(every layer recompiles, then runs eagerly); use zero_stage {other} or compile: false")
    if role == "train" and o.mixed_precision is False and o.dtype == "bfloat16":
        errors.append(f"{path}.mixed_precision: DeepSpeed's bf16 mode always keeps fp32 master weights and "
                      f"optimizer states; remove mixed_precision (or use engine: hf for pure bf16)")
    return errors


def merged_config(o: BaseModel, role: str = "train") -> dict[str, Any]:
    """Our generated config with the user's ``deepspeed:`` block merged over it (the options
    were checked for conflicts when validated)."""
    out = _generated(o, role)
    _merge(out, copy.deepcopy(dict(o.deepspeed)))
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


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


class _DSModel:
    """What the train and infer engines share: loading, initialising and the forward."""

    memory_model = "zero"  # Engine.memory_model: ZeRO partitions by zero_stage

    @classmethod
    def shard_stage(cls, options: BaseModel) -> int:
        """``zero_stage`` (``Engine.shard_stage``)."""
        return options.zero_stage

    def _init_engine(self, spec: EngineSpec, role: str, **init_kwargs) -> None:
        import deepspeed

        init_distributed(spec)
        self.ds_config = merged_config(self.options, role)
        if role == "train":
            _cpu_adam_or_torch(self.ds_config)
        self.zero_stage = int(self.ds_config["zero_optimization"]["stage"])
        self.hf = _load(spec, keep_dropout=role == "train" and self.options.dropout)
        lora = self.adapter_options(self.options) if role == "train" else None
        if lora is not None:  # before DeepSpeed sees the model: only the adapters reach its optimizer
            self.hf.model = apply_lora(self.hf.model, lora, self.options.gradient_checkpointing)
            init_kwargs["model_parameters"] = [p for p in self.hf.model.parameters() if p.requires_grad]
        if role == "train" and self.options.gradient_checkpointing:
            self.hf.model.gradient_checkpointing_enable()
        self.engine, *_ = deepspeed.initialize(model=self.hf.model, config=self.ds_config, **init_kwargs)
        self.hf.model = self.engine  # the engine's forward runs the ZeRO-3 gather hooks
        self.hf.device = self.engine.device
        self.module: torch.nn.Module = self.engine.module
        self.device = self.engine.device
        self.lora = LoraModel(self.module, lora) if lora is not None else None
        self.hf.prepare()  # after placement: the probe runs where the engine will (a collective under ZeRO-3)

    @property
    def packed(self) -> bool:
        return self.hf.attention_path != "padded"

    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None) -> ForwardOutput:
        return self.hf.forward(batch, need_entropy, gather)

    def release_gathered(self) -> None:
        """ZeRO-3 keeps parameters gathered after a no-grad forward (they are "reused soon"
        within ``stage3_max_reuse_distance``); give them back so inference does not end
        holding the whole model. No-op below stage 3."""
        if self.zero_stage == 3:
            self.engine.empty_partition_cache()

    def infer(self, batch: Batch) -> Batch:
        try:
            return InferEngine.infer(self, batch)
        finally:
            self.release_gathered()

    @property
    def collective_weights(self) -> bool:
        return self.zero_stage == 3

    @property
    def equal_micro_batches(self) -> bool:
        """ZeRO-3 gathers parameters in every forward; ZeRO-2 and 3 reduce gradients in every
        backward (stage 0 and 1 only at the accumulation boundary, once per step)."""
        return self.zero_stage == 3 or (isinstance(self, TrainEngine) and self.zero_stage == 2)

    def _state_items(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's state-dict pairs (those whose key ``keep`` accepts). ZeRO 0-2: as they
        are; ZeRO-3: gathered bucket by bucket (a collective: every rank must consume the
        iterator to the end)."""
        if self.zero_stage < 3:
            yield from ((k, v) for k, v in self.module.state_dict().items() if keep is None or keep(k))
            return
        self.release_gathered()
        self.gather_stats = {}
        yield from gathered_weights(self.module, self.gather_bucket_bytes, self.gather_stats, keep)

    def _save_full(self, path: str) -> None:
        """HF-format directory at ``path`` from any stage; called on every rank, rank 0 writes.

        Under ZeRO-3 every rank joins the bucket-by-bucket gather and rank 0 keeps a CPU copy.
        """
        rank = dist.get_rank()
        if self.zero_stage < 3:
            if rank == 0:
                save_with_tokenizer(self.module, self.spec.model_path, path)
            return
        state = {}
        for name, t in self._state_items():
            if rank == 0:
                state[name] = t.cpu()
        if rank == 0:
            save_with_tokenizer(self.module, self.spec.model_path, path, state_dict=state)


@ENGINES.register("deepspeed.train")
class DeepSpeedTrainEngine(LoraTraining, _DSModel, TrainEngine):
    """Training with DeepSpeed ZeRO stage 0-3, optional optimizer / parameter CPU offload.
    Options: ``DeepSpeedTrainOptions``."""

    Options = DeepSpeedTrainOptions
    requires = ("deepspeed",)
    pip_extra = "deepspeed"

    @classmethod
    def sharding_options(cls, stage: int, offload: bool = False) -> dict[str, Any] | None:
        """ZeRO ``stage``; optimizer offload from stage 1."""
        return {"zero_stage": stage, **({"offload_optimizer": True} if offload and stage else {})}

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        o = self.options
        schedule = lr_lambda(o.lr_warmup_steps, spec.total_steps, o.lr_schedule)
        self._init_engine(self.spec, "train", lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        self.gather_bucket_bytes = int(o.gather_bucket_mb * (1 << 20))
        self.gather_stats: dict[str, int] = {}
        self.engine.train()
        self.dp_world_size = dist.get_world_size()

    def infer(self, batch: Batch) -> Batch:
        self.engine.eval()
        try:
            return super().infer(batch)
        finally:
            self.engine.train()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        # DeepSpeed averages gradients over DP ranks; the contract wants their sum.
        self.engine.backward(loss * self.dp_world_size, scale_wrt_gas=False)

    def optimizer_step(self) -> dict[str, float]:
        lr = self.engine.get_lr()[0]
        norm = self._grad_norm_stage0() if self.zero_stage == 0 else None
        self.engine.step()
        if norm is None:
            norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return {"grad_norm": norm, "lr": lr, "skipped": float(not self.engine.was_step_applied())}

    def _grad_norm_stage0(self) -> float:
        """ZeRO-0 keeps no norm: the all-reduced gradients' 2-norm, before clipping."""
        grads = [p.grad.detach().float() for p in self.module.parameters() if p.grad is not None]
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
            lora = {} if self.lora is None else {"lora_base": self.lora.base_fingerprint()}
            self.engine.save_checkpoint(str(tmp), tag="state", client_state=lora,
                                        exclude_frozen_parameters=self.lora is not None)
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
        self.engine.save_checkpoint(path, tag="state", client_state={})
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
        loaded, _ = self.engine.load_checkpoint(path, tag="state")
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
            path, client = self.engine.load_checkpoint(str(tmp), tag="state", load_module_strict=self.lora is None)
            if path is None:
                raise ValueError("DeepSpeedTrainEngine.load_state_dict: DeepSpeed found no checkpoint in the state")
            dist.barrier()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.lora is not None:  # the frozen base is not in the files: it must be the one they were made on
            self.lora.check_base((client or {}).get("lora_base"))


@ENGINES.register("deepspeed.infer")
class DeepSpeedInferEngine(_DSModel, InferEngine):
    """A frozen model (reference, reward) under DeepSpeed: replicated (``zero_stage`` 0, the
    default) or partitioned across the handle's ranks (``zero_stage: 3``, optionally with
    ``offload_params``), without an optimizer. Under ZeRO-3 ``infer`` is a collective: every
    rank runs the same number of micro-batches (the handle splits batches evenly).
    Options: ``DeepSpeedInferOptions``."""

    Options = DeepSpeedInferOptions
    requires = ("deepspeed",)
    pip_extra = "deepspeed"

    @classmethod
    def sharding_options(cls, stage: int, offload: bool = False) -> dict[str, Any] | None:
        """ZeRO 0 or 3 (no optimizer to partition, nor to offload)."""
        return {"zero_stage": stage} if stage in (0, 3) and not offload else None

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        self._init_engine(self.spec, "infer")
        self.engine.eval()
        self.module.requires_grad_(False)
