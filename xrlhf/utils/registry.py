"""Name -> object registries with decorators, used for engines, algorithms, envs, estimators,
weight-sync transports and tools.

Everywhere a registered name is accepted, an import path ``pkg.mod:Attr`` works too, so a
user's own class in their own module can be chosen from YAML without touching xrlhf.

A registry may be *lazy*: given a ``package``, it finds its plug-ins by file, one module per
plug-in, and imports a module only when one of its names is asked for (``get``) or every name
is listed (``names``). No module lists its plug-ins: adding one means adding a file that
registers itself (STYLE principle 15). A plug-in module must therefore be cheap to import:
heavy libraries (vLLM, DeepSpeed) are imported inside the functions that use them.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of objects (classes or functions) of one kind.

    Args:
        kind: what is registered, used in error messages ("engine", "env", ...).
        package: a package whose modules register the plug-ins (lazy discovery); a name
            ``a`` or ``a.b`` is looked for in module ``<package>.a``.
        skip: modules of ``package`` that are not plug-ins (never imported by discovery).
    """

    def __init__(self, kind: str, package: str | None = None, skip: tuple[str, ...] = ()):
        self.kind = kind
        self.package = package
        self.skip = set(skip)
        self._items: dict[str, T] = {}
        self._discovered = False

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``. A duplicate name raises ``ValueError``."""

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._items[name]!r})")
            self._items[name] = obj
            return obj

        return deco

    def modules(self) -> list[str]:
        """The plug-in module names of the lazy ``package`` (without importing them)."""
        if self.package is None:
            return []
        pkg = importlib.import_module(self.package)
        return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)
                      if not m.name.startswith("_") and m.name not in self.skip)

    def _load(self, module: str) -> None:
        importlib.import_module(f"{self.package}.{module}")

    def discover(self) -> None:
        """Import every plug-in module of the lazy ``package`` once (they register themselves)."""
        if self._discovered or self.package is None:
            return
        for m in self.modules():
            self._load(m)
        self._discovered = True

    def names(self) -> list[str]:
        self.discover()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        self._find(name)
        return name in self._items

    def _find(self, name: str) -> None:
        """Import the module that should register ``name`` (lazy registries), if there is one."""
        if name in self._items or self.package is None or ":" in name:
            return
        module = name.split(".")[0]
        if module in self.modules():
            self._load(module)

    def get(self, name: str) -> T:
        """Look up ``name`` (importing its module in a lazy registry), or import ``pkg.mod:Attr``.

        Raises:
            KeyError: with a message listing the valid names (or why the import failed).
        """
        self._find(name)
        if name in self._items:
            return self._items[name]
        if ":" in name:
            return import_path(name)
        raise KeyError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())} "
                       f"(or an import path 'pkg.module:Name')")


def import_path(path: str):
    """Import ``pkg.mod:Attr`` and return ``Attr``; raises ``KeyError`` with a readable reason.

    Any failure of the import is that reason, in one line: a missing module, a ``SyntaxError``
    (with its file and line) or whatever the module's own code raised while it was imported.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise KeyError(f"{path!r} is not an import path of the form 'pkg.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise KeyError(f"cannot import module {module_name!r} of {path!r}: {e}") from None
    except SyntaxError as e:  # the user's file does not parse: say where
        raise KeyError(f"cannot import module {module_name!r} of {path!r}: SyntaxError: {e.msg} "
                       f"({e.filename}, line {e.lineno}); fix the file") from None
    except Exception as e:  # noqa: BLE001 - the module's own code raised while it was imported
        raise KeyError(f"cannot import module {module_name!r} of {path!r}: importing it raised "
                       f"{type(e).__name__}: {_first_line(e)}; fix the module") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise KeyError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else "(no message)"
