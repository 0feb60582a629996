"""Load YAML, apply dotted overrides, validate, and report every problem at once.

Each problem is one line prefixed by its dotted YAML path::

    policy.train.micro_batch_size: must be >= 1, got 0
    algorithm.kl_coeff: unknown key (valid: clip_eps, gamma, kl_coef, ...)

``load_config`` raises ``UserError`` with all lines; the CLI prints them and exits 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from xrlhf.config.schema import XConfig
from xrlhf.utils.errors import UserError

_MESSAGES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "missing": "is required",
}


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or bad YAML is a ``UserError``."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such config file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place."""
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not k for k in key.split(".")):
            errors.append(f"{item}: an override must look like section.key=value")
            continue
        value = _parse_value(raw)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                if part in node and node[part] is not None:
                    errors.append(f"{key}: {part!r} is not a section (it holds {node[part]!r})")
                    break
                node[part] = {}
            node = node[part]
        else:
            node[parts[-1]] = value
    if errors:
        raise UserError(*errors)
    return data


def _parse_value(raw: str) -> Any:
    """A command-line value as YAML would read it, plus ``1e-5`` as a float (YAML 1.1 says str)."""
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def format_errors(err: ValidationError, model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """One line per pydantic error: ``dotted.path: message, got <value>``."""
    lines = []
    for e in err.errors(include_url=False):
        loc = [str(x) for x in e["loc"]]
        path = ".".join(([prefix] if prefix else []) + loc)
        kind = e["type"]
        if kind == "extra_forbidden":
            valid = _valid_keys(model, e["loc"][:-1]) if model else []
            msg = "unknown key" + (f" (valid: {', '.join(valid)})" if valid else "")
        elif kind in _MESSAGES:
            msg = _MESSAGES[kind].format(**{k: _num(v) for k, v in e.get("ctx", {}).items()})
            if kind != "missing":
                msg += f", got {e['input']!r}"
        elif kind == "value_error":
            msg = str(e["ctx"]["error"]) if "ctx" in e else e["msg"]
            if not loc:  # a cross-field check: its message names its own paths (one per line)
                lines.extend(msg.splitlines())
                continue
        else:
            msg = f"{e['msg'][0].lower()}{e['msg'][1:]}, got {e['input']!r}"
        lines.append(f"{path}: {msg}" if path else msg)
    return lines


def _num(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _valid_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the section at ``loc`` in ``model`` (best effort)."""
    import typing

    cls: Any = model
    for part in loc:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        cls = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if cls is None:
            return []
    return sorted(getattr(cls, "model_fields", {}))


def validate_dict(data: dict[str, Any]) -> XConfig:
    """Validate a config dict: the schema, the env and algorithm options, then cross-checks.

    All problems found are reported together; the algorithm's cross-section checks run only
    once everything else is valid (they read validated values).
    """
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
        errors += _check_names(cfg)
    if not errors and cfg is not None:
        errors += ALGORITHMS().get(cfg.algorithm.name).check_config(cfg, parsed["algorithm"])
    if cfg is not None:
        errors += _validate_engine_sections(cfg)
    if errors:
        raise UserError(*errors)
    return cfg


_BACKEND_PACKAGES = {"deepspeed": ("deepspeed", "deepspeed"), "vllm": ("vllm", "gpu")}


def _check_names(cfg: XConfig) -> list[str]:
    """Engines and reward functions named in the config exist (without importing heavy libraries)."""
    import importlib.util

    from xrlhf.engines.base import engine_names
    from xrlhf.utils.registry import import_path

    errors = []
    sections = [(f"{h}.{role}", getattr(getattr(cfg, h), role), role)
                for h, role in (("policy", "train"), ("policy", "generate"), ("critic", "train"),
                                ("reference", "infer"), ("reward", "infer")) if getattr(cfg, h, None) is not None]
    for path, section, role in sections:
        name = section.engine
        if ":" in name:
            try:
                import_path(name)
            except KeyError as e:
                errors.append(f"{path}.engine: {e.args[0]}")
        elif name not in engine_names(role):
            errors.append(f"{path}.engine: no {role} engine {name!r}; valid: {', '.join(engine_names(role))} "
                          f"(or an import path 'pkg.module:Class')")
        elif name in _BACKEND_PACKAGES and importlib.util.find_spec(_BACKEND_PACKAGES[name][0]) is None:
            errors.append(f"{path}.engine: {name!r} needs the {_BACKEND_PACKAGES[name][0]} package; install it with "
                          f"pip install -e '.[{_BACKEND_PACKAGES[name][1]}]'")
    if cfg.reward.source == "function" and cfg.reward.function:
        try:
            import_path(cfg.reward.function)
        except KeyError as e:
            errors.append(f"reward.function: {e.args[0]}")
    return errors


def ALGORITHMS():  # noqa: N802 - imported lazily: the algorithm layer sits above this one
    from xrlhf.algorithms import ALGORITHMS as registry

    return registry


def _validate_registered(section: str, raw: Any) -> tuple[list[str], BaseModel | None]:
    """The options of the named env or algorithm, validated by the class's own ``Config``."""
    from xrlhf.envs import ENVS

    if not isinstance(raw, dict) or not isinstance(raw.get("name", "ppo" if section == "algorithm" else None), str):
        return [], None  # the schema already reported it
    registry = ENVS if section == "env" else ALGORITHMS()
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


def _validate_engine_sections(cfg: XConfig) -> list[str]:
    """Engine-specific checks of the train / infer sections (DeepSpeed options and conflicts)."""
    from xrlhf.config.deepspeed import section_errors

    sections = [("policy.train", "train", cfg.policy.train.model_dump())]
    if cfg.critic is not None:
        sections.append(("critic.train", "train", cfg.critic.train.model_dump()))
    if cfg.reference is not None:
        sections.append(("reference.infer", "infer", cfg.reference.infer.model_dump()))
    if cfg.reward.source == "model":
        sections.append(("reward.infer", "infer", cfg.reward.infer.model_dump()))
    return section_errors(sections)


def load_config(path: str | Path, overrides: list[str] | None = None) -> XConfig:
    """Read, override and validate a config; raises ``UserError`` listing every problem."""
    data = apply_overrides(read_yaml(path), list(overrides or []))
    data.setdefault("name", Path(path).stem)
    return validate_dict(data)


def algorithm_options(cfg: XConfig) -> BaseModel:
    """The validated options of ``cfg.algorithm`` (its class's ``Config``)."""
    return ALGORITHMS().get(cfg.algorithm.name).Config.model_validate(cfg.algorithm.options())


def dump_config(cfg: XConfig) -> str:
    """The resolved config as YAML (what ``config.yaml`` in the run directory holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
