"""Load YAML, apply dotted overrides, validate, and report every problem at once.

Each problem is one line prefixed by its dotted YAML path::

    policy.train.micro_batch_size: must be >= 1, got 0
    algorithm.kl_coeff: unknown key (valid: clip_eps, gamma, kl_coef, ...)

This module is a leaf: it knows the YAML and the schema, never a registry. Checks that need
the registered engines, algorithms, envs and functions live in the shell, ``xrlhf.validation``
(whose ``load_config`` raises ``UserError`` with all lines; the CLI prints them and exits 2).
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
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place; a list
    item is named by its index, ``env.options.tools[0].options.timeout_s=2``."""
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        path = _override_path(key) if sep else None
        if path is None:
            errors.append(f"{item}: an override must look like section.key=value (a list item: key[0])")
            continue
        node: Any = data
        for here, step in enumerate(path[:-1]):
            child = _child(node, step, path[here + 1], key, errors)
            if child is None:
                break
            node = child
        else:
            if isinstance(path[-1], int):
                if _in_range(node, path[-1], key, errors):
                    node[path[-1]] = _parse_value(raw)
            else:
                node[path[-1]] = _parse_value(raw)
    if errors:
        raise UserError(*errors)
    return data


def _override_path(key: str) -> list[str | int] | None:
    """``a.b[0].c`` -> ``['a', 'b', 0, 'c']``; ``None`` when it is not such a path."""
    path: list[str | int] = []
    for part in key.split("."):
        name, _, rest = part.partition("[")
        if not name:
            return None
        path.append(name)
        while rest:
            index, close, rest = rest.partition("]")
            if not close or not index.isdigit() or (rest and not rest.startswith("[")):
                return None
            path.append(int(index))
            rest = rest[1:]
    return path


def _child(node: Any, step: str | int, following: str | int, key: str, errors: list[str]) -> Any:
    """The container ``step`` names in ``node`` (a new section where a key is missing); ``None``
    with an error line where there is none."""
    if isinstance(step, int):
        return node[step] if _in_range(node, step, key, errors) and _container(node[step], following, key,
                                                                              f"item {step}", errors) else None
    if step not in node or node[step] is None:
        if isinstance(following, int):
            errors.append(f"{key}: {step!r} holds no list to index")
            return None
        node[step] = {}
    return node[step] if _container(node[step], following, key, repr(step), errors) else None


def _container(value: Any, following: str | int, key: str, what: str, errors: list[str]) -> bool:
    if isinstance(following, int) and not isinstance(value, list):
        errors.append(f"{key}: {what} is not a list (it holds {value!r})")
        return False
    if isinstance(following, str) and not isinstance(value, dict):
        errors.append(f"{key}: {what} is not a section (it holds {value!r})")
        return False
    return True


def _in_range(node: Any, index: int, key: str, errors: list[str]) -> bool:
    if not isinstance(node, list):
        errors.append(f"{key}: [{index}] indexes something that is not a list (it holds {node!r})")
        return False
    if index >= len(node):
        errors.append(f"{key}: index {index} is out of range; the list holds {len(node)} item(s)")
        return False
    return True


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


def dump_config(cfg: XConfig | dict[str, Any]) -> str:
    """A config as YAML: what ``config.yaml`` in the run directory holds, given the resolved
    dict (``xrlhf.validation.resolved_config``: the owners' options with their defaults); an
    ``XConfig`` is dumped as the schema has it."""
    return yaml.safe_dump(cfg if isinstance(cfg, dict) else cfg.model_dump(mode="json"), sort_keys=False)
