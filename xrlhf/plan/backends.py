"""What the planner asks of a backend, read from its engine class, never from its name.

The planner's records (``memory.Trainer``, ``memory.Generator``, ``inputs.Frozen``) keep the
engine's name (a backend or an import path ``pkg.mod:Class``) as data; every decision that
depends on the backend goes through the class's hooks (``engines.base.Engine``:
``memory_model``, ``sharding_options``, ``sleep_levels``, ``tensor_parallel``), so a backend a
user registers is planned from its own class attributes.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from xrlhf.engines.base import Role, engine_class, engine_names


@cache
def backend(engine: str, role: Role) -> type:
    """The engine class of ``engine`` in ``role`` (cached: the planner asks in every layout)."""
    return engine_class(engine, role)


def paged(g) -> bool:
    """Whether generator ``g`` (``memory.Generator``) is planned as a paged KV cache (vLLM's)."""
    return backend(g.engine, "generate").memory_model == "paged"


def sleep_levels(engine: str) -> tuple[int, ...]:
    """The sleep levels a generate engine takes, deepest first (``(0,)``: it never sleeps)."""
    return backend(engine, "generate").sleep_levels


def zero_stage(t) -> int:
    """The ZeRO stage trainer ``t`` (``memory.Trainer``) partitions at (0 unless its memory is ZeRO's)."""
    return t.zero_stage if backend(t.engine, "train").memory_model == "zero" else 0


def sharding(engine: str, role: Role, zero: int, offload: bool = False) -> tuple[str, dict[str, Any]] | None:
    """``(backend, its options)`` that partition ``role`` at ZeRO stage ``zero``: ``engine`` itself
    where it can, else the first registered backend that can; ``None`` where none can."""
    for name in (engine, *engine_names(role)):
        options = backend(name, role).sharding_options(zero, offload)
        if options is not None:
            return name, options
    return None


def shard_overrides(path: str, engine: str, role: Role, zero: int, offload: bool = False) -> dict[str, Any]:
    """The overrides of section ``path`` (``policy.train``) that partition it as ``sharding`` says
    (empty where no backend can), the engine first."""
    found = sharding(engine, role, zero, offload)
    if found is None:
        return {}
    name, options = found
    return {f"{path}.engine": name, **{f"{path}.{k}": v for k, v in options.items()}}


def as_args(overrides: dict[str, Any]) -> str:
    """``overrides`` as ``xrlhf run`` takes them, space-separated."""
    return " ".join(f"{k}={yaml_value(v)}" for k, v in overrides.items())


def yaml_value(v: Any) -> str:
    """``v`` as YAML writes it (``true``, ``null``, ``3``)."""
    return "null" if v is None else ("true" if v is True else "false" if v is False else str(v))
