"""The DeepSpeed engines' options and the DeepSpeed config made from them.

Read by validation without DeepSpeed installed (nothing here imports it). A free ``deepspeed:``
block is merged over the generated config; a key xrlhf owns (``OWNED``) or derives from a field
whose value differs (``DERIVED``) is an error, never overridden silently (``conflicts``).
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from xrlhf.config.schema import yaml_path
from xrlhf.engines.base import InferOptions, TrainOptions
from xrlhf.engines.hf.infer import TOPK_FIELD
from xrlhf.engines.hf.model import HFModelOptions
from xrlhf.engines.hf.train import MIXED_PRECISION_FIELD, train_errors
from xrlhf.engines.lora import LORA_FIELD, LoraOptions

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
