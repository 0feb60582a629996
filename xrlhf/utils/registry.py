"""Name -> object registries with decorators, used for engines, algorithms, envs, estimators.

Everywhere a registered name is accepted, an import path ``pkg.mod:Attr`` works too, so a
user's own class in their own module can be chosen from YAML without touching xrlhf.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of objects (classes or functions) of one kind.

    Args:
        kind: what is registered, used in error messages ("engine", "env", ...).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``. A duplicate name raises ``ValueError``."""

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._items[name]!r})")
            self._items[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def get(self, name: str) -> T:
        """Look up ``name``, or import ``pkg.mod:Attr``.

        Raises:
            KeyError: with a message listing the valid names (or why the import failed).
        """
        if name in self._items:
            return self._items[name]
        if ":" in name:
            return import_path(name)
        raise KeyError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())} "
                       f"(or an import path 'pkg.module:Name')")


def import_path(path: str):
    """Import ``pkg.mod:Attr`` and return ``Attr``; raises ``KeyError`` with a readable reason."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise KeyError(f"{path!r} is not an import path of the form 'pkg.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise KeyError(f"cannot import module {module_name!r} of {path!r}: {e}") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise KeyError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj
