"""Installed releases of packages, compared by major and minor release."""

from __future__ import annotations

import importlib.metadata
import re
import sys


def release(version: str) -> tuple[int, int]:
    """``"2.14.0+cu130"`` -> ``(2, 14)``; ``"0.33.0rc1"`` -> ``(0, 33)``."""
    parts = [int(m.group()) if (m := re.match(r"\d+", p)) else 0 for p in version.split(".")[:2]]
    return tuple((parts + [0, 0])[:2])  # type: ignore[return-value]


def installed(package: str) -> str | None:
    """The installed version of ``package`` (``"python"``: the interpreter's), ``None`` if absent.
    A package imported without distribution metadata (vendored, or a test's stand-in) gives its
    module's ``__version__``."""
    if package == "python":
        return "{}.{}.{}".format(*sys.version_info[:3])
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules.get(package), "__version__", None)
        return version if isinstance(version, str) else None


def pinned(package: str, dependency: str) -> str | None:
    """The version ``package`` pins ``dependency`` to (``dependency==X`` among its requirements,
    markers ignored), ``None`` if it pins none or is not installed."""
    try:
        requirements = importlib.metadata.requires(package) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requirements:
        m = re.match(rf"\s*{re.escape(dependency)}\s*==\s*([\w.+!-]+)\s*(;.*)?$", line, re.IGNORECASE)
        if m and "extra ==" not in (m.group(2) or ""):
            return m.group(1)
    return None
