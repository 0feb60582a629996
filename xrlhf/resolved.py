"""A run's config as every component resolves it: what ``config.yaml`` holds, what ``--resume`` compares.

The schema (``xrlhf.config``) knows the shared sections; the algorithm's options, the env's and
each engine's are validated by their owners (``xrlhf.validation``), and a plain dump of the
schema keeps only what the YAML gave for them. Here they are resolved by their owners, defaults
included, so that a value given explicitly equals its default left out.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from xrlhf.config.schema import XConfig

ENGINE_SECTIONS = (("policy", "train", "train"), ("policy", "generate", "generate"), ("critic", "train", "train"),
                   ("reference", "infer", "infer"), ("reward", "infer", "infer"),
                   ("teacher", "infer", "infer"))
"""``(handle, section, role)`` of every engine section a config may have."""


def resolved_config(cfg: XConfig) -> dict[str, Any]:
    """``cfg`` as a run's ``config.yaml`` holds it: every value the run uses, defaults included
    (:func:`resolve_dict` of its dump)."""
    return resolve_dict(cfg.model_dump(mode="json"))


def resolve_dict(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict (a validated config's dump, or a run's ``config.yaml``) with the sections the
    schema leaves to their owners resolved by them: the ``algorithm`` section by the algorithm's
    ``Config``, ``env.options`` by the env's, each engine section by its engine's ``Options``,
    defaults included. So a value given explicitly equals its default left out (``--resume``
    compares resolved configs). A section that does not validate (written by another version)
    is kept as it is. Returns a new dict."""
    from xrlhf.engines.base import engine_class
    from xrlhf.envs import ENVS

    data = copy.deepcopy(data)
    algo, env = data.get("algorithm"), data.get("env")
    if isinstance(algo, dict):
        name = algo.get("name", "ppo")
        resolved = _resolved(lambda: _algorithm(name).Config, {k: v for k, v in algo.items() if k != "name"})
        if resolved is not None:
            data["algorithm"] = {"name": name, **{k: v for k, v in resolved.items() if k != "name"}}
    if isinstance(env, dict) and isinstance(env.get("name"), str):
        resolved = _resolved(lambda: ENVS.get(env["name"]).Config, env.get("options") or {})
        if resolved is not None:
            env["options"] = resolved
    for handle, key, role in ENGINE_SECTIONS:
        section = (data.get(handle) or {}).get(key) if isinstance(data.get(handle), dict) else None
        if isinstance(section, dict) and isinstance(section.get("engine", "hf"), str):
            fields = {k: v for k, v in section.items() if k != "resources"}
            resolved = _resolved(lambda s=section, r=role: engine_class(s.get("engine", "hf"), r).Options, fields,
                                 {"path": f"{handle}.{key}"})
            if resolved is not None:
                data[handle][key] = {**resolved, **({"resources": section["resources"]} if "resources" in section
                                                    else {})}
    return data


def _resolved(model, values: dict[str, Any], context: dict | None = None) -> dict[str, Any] | None:
    """``values`` validated by ``model()`` and dumped with defaults; ``None`` if either fails."""
    try:
        return model().model_validate(values, context=context).model_dump(mode="json")
    except (KeyError, TypeError, ValidationError):
        return None


def _algorithm(name: str):
    from xrlhf.algorithms import ALGORITHMS

    return ALGORITHMS.get(name)
