"""Validation of a whole config against what is registered: the shell's half of ``xrlhf validate``.

``xrlhf.config`` validates the YAML against the schema and knows no registry (a leaf). Here,
beside the runner, the rest is checked before anything starts, every problem reported at once
as ``dotted.yaml.path: message``:

* the env's and algorithm's options, by the registered class's own ``Config``;
* every engine section by the chosen engine's own ``Options`` (unknown keys rejected; a key
  that belongs to another backend of the role says which), the packages it needs, and where
  it can run (``GenerateEngine.placement_errors``);
* a reward function's import path;
* then, once all of that is valid, the algorithm's cross-section checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from xrlhf.config.loader import apply_overrides, format_errors, read_yaml
from xrlhf.config.schema import Section, XConfig
from xrlhf.utils.errors import UserError


def load_config(path: str | Path, overrides: list[str] | None = None) -> XConfig:
    """Read, override and validate a config; raises ``UserError`` listing every problem."""
    data = apply_overrides(read_yaml(path), list(overrides or []))
    data.setdefault("name", Path(path).stem)
    return validate_dict(data)


def validate_dict(data: dict[str, Any]) -> XConfig:
    """Validate a config dict: the schema, registered options, engines, then cross-checks."""
    errors: list[str] = []
    cfg = None
    try:
        cfg = XConfig.model_validate(data)
    except ValidationError as e:
        errors += format_errors(e, XConfig)
    parsed = {}
    for section in ("env", "algorithm"):
        lines, parsed[section] = _validate_registered(section, data.get(section))
        errors += lines
    if cfg is not None:
        errors += engine_errors(cfg) + _transport_errors(cfg) + _reward_function_errors(cfg)
    if not errors and cfg is not None:
        errors += _algorithms().get(cfg.algorithm.name).check_config(cfg, parsed["algorithm"])
    if errors:
        raise UserError(*errors)
    return cfg


def algorithm_options(cfg: XConfig) -> BaseModel:
    """The validated options of ``cfg.algorithm`` (its class's ``Config``)."""
    return _algorithms().get(cfg.algorithm.name).Config.model_validate(cfg.algorithm.options())


def _algorithms():
    from xrlhf.algorithms import ALGORITHMS

    return ALGORITHMS


def _validate_registered(section: str, raw: Any) -> tuple[list[str], BaseModel | None]:
    """The options of the named env or algorithm, validated by the class's own ``Config``."""
    from xrlhf.envs import ENVS

    if raw is None and section == "algorithm":
        raw = {"name": "ppo"}  # the schema's default section
    if not isinstance(raw, dict) or not isinstance(raw.get("name", "ppo" if section == "algorithm" else None), str):
        return [], None  # the schema already reported it
    registry = ENVS if section == "env" else _algorithms()
    name = raw.get("name", "ppo")
    try:
        cls = registry.get(name)
    except KeyError as e:
        return [f"{section}.name: {e.args[0]}"], None
    if section == "env":
        options, prefix = raw.get("options") or {}, "env.options"
        if not isinstance(options, dict):
            return [], None
    else:
        options, prefix = {k: v for k, v in raw.items() if k != "name"}, "algorithm"
    try:
        return [], cls.Config.model_validate(options)
    except ValidationError as e:
        return format_errors(e, cls.Config, prefix), None


def engine_errors(cfg: XConfig) -> list[str]:
    """Every engine section checked by its engine: name, packages, options, placement."""
    errors = []
    for path, role, section in cfg.engine_sections():
        errors += _section_errors(cfg, path, role, section)
    return errors


def _section_errors(cfg: XConfig, path: str, role: str, section: Section) -> list[str]:
    from xrlhf.engines.base import engine_class

    try:
        cls = engine_class(section.engine, role)  # type: ignore[arg-type]
    except KeyError as e:
        return [f"{path}.engine: {e.args[0]}"]
    errors = []
    missing = cls.missing_packages()
    if missing:
        how = f"pip install -e '.[{cls.pip_extra}]'" if cls.pip_extra else "pip install " + " ".join(missing)
        errors.append(f"{path}.engine: {section.engine!r} needs the {', '.join(missing)} package; install it with "
                      f"{how}")
    fields = section.engine_fields()
    for key in sorted(set(fields) - set(cls.Options.model_fields)):
        owners = _backends_with_option(role, key)
        if owners:
            errors.append(f"{path}.{key}: an option of engine {' or '.join(map(repr, owners))}, but {path}.engine is "
                          f"{section.engine!r}; remove it or set {path}.engine: {owners[0]}")
            del fields[key]
    try:
        options = cls.Options.model_validate(fields, context={"path": path})
    except ValidationError as e:
        return errors + format_errors(e, cls.Options, path)
    if role == "generate":
        split = cfg.policy.generate.resources is not None
        res = cfg.policy.generate.resources if split else cfg.policy.resources
        where = "policy.generate.resources" if split else "policy.resources"
        errors += cls.placement_errors(options, where, res.gpus_per_rank, split)
    return errors


def _backends_with_option(role: str, key: str) -> list[str]:
    """Registered backends of ``role`` whose options have a field ``key``."""
    from xrlhf.engines.base import engine_class, engine_names

    return [n for n in engine_names(role) if key in engine_class(n, role).Options.model_fields]  # type: ignore[arg-type]


def _transport_errors(cfg: XConfig) -> list[str]:
    """``policy.weight_sync.transport`` names a registered transport (or ``auto``)."""
    from xrlhf.weight_sync import TRANSPORTS

    name = cfg.policy.weight_sync.transport
    if name == "auto" or name in TRANSPORTS:
        return []
    return [f"policy.weight_sync.transport: unknown transport {name!r}; valid: auto, {', '.join(TRANSPORTS.names())}"]


def _reward_function_errors(cfg: XConfig) -> list[str]:
    from xrlhf.utils.registry import import_path

    if cfg.reward.source == "function" and cfg.reward.function:
        try:
            import_path(cfg.reward.function)
        except KeyError as e:
            return [f"reward.function: {e.args[0]}"]
    return []
