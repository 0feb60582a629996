"""Whether Python can reuse the compiled bytecode of the big packages every worker imports.

Each Ray worker is a fresh Python process that imports torch and transformers (and vLLM in a
generator). Where their ``__pycache__`` holds no valid ``.pyc`` and Python may not write one (a
read-only image, ``PYTHONDONTWRITEBYTECODE=1``), every process compiles thousands of modules from
source, seconds of every worker's start in every run (docs/testing.md). ``init_ray`` warns once
with the fix.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

PACKAGES = ("torch", "transformers", "vllm")
"""What a worker imports at start (vLLM in a generator), checked where installed."""


def valid_pyc(source: str | Path) -> bool:
    """Whether the bytecode Python would read for ``source`` (a ``.py`` file) exists and matches it:
    the interpreter's magic number and, for a timestamp-checked ``.pyc``, the source's mtime and
    size (a hash-checked one counts as valid). Honours ``PYTHONPYCACHEPREFIX``."""
    try:
        pyc = importlib.util.cache_from_source(str(source))
        with open(pyc, "rb") as f:
            head = f.read(16)
        st = os.stat(source)
    except (OSError, NotImplementedError, ValueError):
        return False
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(head[4:8], "little") & 0b1:  # hash-based
        return True
    return (int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)


def uncompiled(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """The installed packages of ``packages`` whose ``__init__.py`` has no valid bytecode (the
    sign of a package compiled from source in every new process). Imports nothing."""
    out = []
    for name in packages:
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
        origin = getattr(spec, "origin", None)
        if origin and origin.endswith(".py") and not valid_pyc(origin):
            out.append(name)
    return out


def warning(packages: list[str]) -> str:
    """The one-line warning for ``packages`` (from ``uncompiled``)."""
    where = str(Path(importlib.util.find_spec(packages[0]).origin).parents[1])
    return (f"{', '.join(packages)}: no usable bytecode cache (a read-only environment or PYTHONDONTWRITEBYTECODE), "
            f"so every worker compiles their modules from source (6-7 s per worker on a GPU machine, "
            f"docs/benchmarks.md). Fix: export PYTHONPYCACHEPREFIX=$HOME/.cache/pycache; python -m compileall -q -j 0 {where}")
