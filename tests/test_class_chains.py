"""No xrlhf class has more than four of xrlhf's own classes in its MRO (mixins count): a varying
part is passed in, not inherited (issue 52; the staged plan: docs/design/composition.md).
``TOWERS`` lists today's deeper chains with their depth; it only shrinks: a row that is no longer
needed fails the test too."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import xrlhf

LIMIT = 4
OPTIONAL = {"vllm", "deepspeed", "peft", "ray", "wandb", "trl"}
"""A module that needs one of these where it is not installed is skipped."""

TOWERS: dict[str, int] = {}
"""Chains still over ``LIMIT``: class -> how many of our classes its MRO has. None left: keep it so."""


def own(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "xrlhf"


def classes():
    for info in pkgutil.walk_packages(xrlhf.__path__, "xrlhf."):
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in OPTIONAL:
                continue
            raise
        yield from (v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == info.name)


def test_no_chain_deeper_than_four():
    chains = {f"{c.__module__}.{c.__qualname__}": [k.__name__ for k in c.__mro__ if own(k)] for c in classes()}
    over = [f"{n}: {' -> '.join(ch)}" for n, ch in chains.items() if len(ch) > TOWERS.get(n, LIMIT)]
    stale = [n for n, cap in TOWERS.items() if len(chains.get(n, ())) < cap]
    assert not over, "more than four of our classes in a chain; pass the varying part in:\n" + "\n".join(over)
    assert not stale, f"shorter than listed: lower or remove its row in TOWERS: {stale}"
