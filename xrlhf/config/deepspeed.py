"""The DeepSpeed config of a train or infer section: our defaults, the user's block, conflicts.

A section with ``engine: deepspeed`` may carry a free ``deepspeed:`` block that is passed to
``deepspeed.initialize`` merged over the config xrlhf generates from the section's own fields.
Merging must never override a user's value silently, so two kinds of keys are refused:

* keys xrlhf owns because the algorithm decides them (``train_batch_size``,
  ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``optimizer``,
  ``scheduler``): always an error, whatever the value;
* keys generated from a field of the section (``gradient_clipping`` from ``grad_clip``,
  ``bf16.enabled`` from ``dtype``, ``zero_optimization.stage`` from ``zero_stage``, the offload
  devices from ``offload_optimizer``/``offload_params``): an error when the value differs.

Everything else in the block (``zero_optimization.reduce_bucket_size``, ``steps_per_print``,
``activation_checkpointing``, ...) is passed through. This module does not import DeepSpeed,
so ``xrlhf validate`` reports the errors before Ray or DeepSpeed start.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

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

DEFAULT_TRAIN_STAGE = 2
DEFAULT_INFER_STAGE = 0
_QUIET = {"steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def _offload(flag: bool) -> dict[str, Any]:
    return {"device": "cpu" if flag else "none"}


def generated_train_config(o: Mapping[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config xrlhf derives from a ``TrainConfig`` dict ``o`` (without the user block).

    fp32 unless ``dtype: bfloat16`` (then DeepSpeed's bf16 mode: bf16 weights, fp32 master
    weights and optimizer states). The optimizer is torch's AdamW (no compiled op) unless the
    optimizer is offloaded, where DeepSpeed's CPU Adam is the point of offloading.
    """
    stage = o.get("zero_stage")
    stage = DEFAULT_TRAIN_STAGE if stage is None else stage
    offload_opt = bool(o.get("offload_optimizer"))
    return {
        "train_micro_batch_size_per_gpu": int(o.get("micro_batch_size", 8)),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(o.get("grad_clip") or 0.0),
        "optimizer": {"type": "AdamW", "params": {
            "lr": float(o.get("lr", 1e-5)), "betas": list(o.get("betas", (0.9, 0.999))),
            "eps": float(o.get("eps", 1e-8)), "weight_decay": float(o.get("weight_decay", 0.0)),
            "torch_adam": not offload_opt}},
        "bf16": {"enabled": o.get("dtype") == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": stage, "offload_optimizer": _offload(offload_opt),
                              "offload_param": _offload(bool(o.get("offload_params")))},
        "zero_allow_untested_optimizer": True,
        **_QUIET,
    }


def generated_infer_config(o: Mapping[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config of a frozen model (``InferConfig`` dict): no optimizer, ZeRO 0 or 3."""
    stage = o.get("zero_stage")
    return {
        "train_micro_batch_size_per_gpu": int(o.get("micro_batch_size", 8)),
        "bf16": {"enabled": o.get("dtype") == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": DEFAULT_INFER_STAGE if stage is None else stage,
                              "offload_param": _offload(bool(o.get("offload_params")))},
        **_QUIET,
    }


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


def conflicts(o: Mapping[str, Any], path: str, role: str = "train") -> list[str]:
    """Errors for the ``deepspeed:`` block of the section dict ``o`` found at YAML ``path``.

    Args:
        o: the section as a dict (``TrainConfig`` / ``InferConfig`` ``model_dump()``).
        path: the section's YAML path, e.g. ``policy.train``.
        role: ``"train"`` or ``"infer"`` (an infer section owns fewer keys).

    Returns:
        one line per problem, each starting with the offending YAML path.
    """
    user = o.get("deepspeed") or {}
    ours = generated_train_config(o) if role == "train" else generated_infer_config(o)
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
            errors.append(f"{path}.deepspeed.{leaf}: conflicts with {path}.dtype ({o.get('dtype')!r}); {hint}")
        else:
            errors.append(f"{path}.deepspeed.{leaf}: {value!r} conflicts with {path}.{field} "
                          f"({o.get(field)!r}); set it there")
    stage = _get(ours, "zero_optimization.stage")
    if o.get("offload_params") and stage != 3:
        errors.append(f"{path}.offload_params: parameter offload needs zero_stage 3, got {stage}")
    if role == "train" and o.get("offload_optimizer") and stage == 0:
        errors.append(f"{path}.offload_optimizer: optimizer offload needs zero_stage 1, 2 or 3, got 0")
    return errors


def merged_config(o: Mapping[str, Any], role: str = "train") -> dict[str, Any]:
    """Our generated config with the user's ``deepspeed:`` block merged over it (checked first).

    Raises:
        ValueError: listing the conflicts, when the block was not validated before.
    """
    errors = conflicts(o, "deepspeed engine", role)
    if errors:
        raise ValueError("; ".join(errors))
    out = generated_train_config(o) if role == "train" else generated_infer_config(o)
    _merge(out, copy.deepcopy(dict(o.get("deepspeed") or {})))
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


DS_ONLY_TRAIN = ("zero_stage", "offload_optimizer", "offload_params", "deepspeed")
DS_ONLY_INFER = ("zero_stage", "offload_params", "deepspeed")


def section_errors(sections: list[tuple[str, str, Mapping[str, Any]]]) -> list[str]:
    """Checks of every engine section: ``(yaml_path, role, section_dict)`` triples.

    A DeepSpeed-only option set while the section's engine is ``hf`` is an error; a
    ``deepspeed`` section gets ``conflicts``. Custom engines (import paths) are not checked.
    """
    errors = []
    for path, role, o in sections:
        engine = o.get("engine")
        if engine == "deepspeed":
            errors += conflicts(o, path, role)
        elif engine == "hf":
            for key in DS_ONLY_TRAIN if role == "train" else DS_ONLY_INFER:
                if o.get(key) not in (None, False, {}):
                    errors.append(f"{path}.{key}: only used by the deepspeed engine "
                                  f"(set {path}.engine: deepspeed, or remove it)")
    return errors
