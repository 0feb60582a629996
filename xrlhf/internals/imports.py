"""The standard library's import metadata, answered once: ``packages_distributions`` once per run,
``entry_points`` once per selection in a worker.

``packages_distributions``: transformers calls it when imported (5.17: at module level) to map
import names to distributions. It reads the file list of every installed distribution that has no
``top_level.txt`` and stats each file (~35,000 stats on the GPU machine's image), paid by the
driver and again by every worker. The driver keeps its answer (``memoize``) and writes it to a
file (``share``); each worker reads it before it imports transformers (``install``). It is the same
answer only where the same distributions are found: the file records the distribution metadata on
the driver's import path (each directory's ``*.dist-info`` / ``*.egg-info`` names, versions in
them), and ``install`` uses it only where the worker's import path finds exactly those.

``entry_points``: reads every installed distribution's entry points on each call; vLLM's plugin
loading calls it several times while its engine starts. A worker installs nothing while it runs, so
it keeps each answer (``cache_entry_points``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import sys
import tempfile

from xrlhf.internals import Hook, needs

ENV = "XRLHF_PACKAGE_MAP"
"""The file ``share`` wrote, set in the workers' environment by ``coordinator.init_ray``."""

PACKAGE_MAP = Hook(
    "python.package_map", "python", ("3.11", "3.12"),
    buys="a worker answers importlib.metadata.packages_distributions from the driver's file "
         "instead of ~35,000 file stats in each transformers import",
    without="each process computes packages_distributions itself",
    probe=needs("importlib.metadata", "packages_distributions"))

ENTRY_POINTS = Hook(
    "python.entry_points", "python", ("3.11", "3.12"),
    buys="a worker answers importlib.metadata.entry_points once per selection (vLLM asks while it starts)",
    without="each call reads every distribution's entry points",
    probe=needs("importlib.metadata", "entry_points"))

ORIGINAL = importlib.metadata.packages_distributions
"""The standard library's own ``packages_distributions``."""
_ENTRY_POINTS = importlib.metadata.entry_points


def _metadata() -> dict[str, list[str]]:
    """Each directory of the import path that holds distribution metadata, with the names of its
    ``*.dist-info`` / ``*.egg-info`` entries (a name carries the version): what
    ``packages_distributions`` reads, and what an install or an uninstall changes."""
    out = {}
    for p in sys.path:
        d = os.path.abspath(p or os.getcwd())
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith((".dist-info", ".egg-info")))
        except OSError:  # not a directory (a zip), or gone
            continue
        if names:
            out[d] = names
    return out


def memoize() -> None:
    """Keep this process's first answer of ``packages_distributions`` (the driver's: its own
    import of transformers computes it, ``share`` then writes the same one)."""
    if importlib.metadata.packages_distributions is ORIGINAL and PACKAGE_MAP.active():
        importlib.metadata.packages_distributions = functools.cache(ORIGINAL)


def share() -> str | None:
    """Write this process's map and import path to a new file; returns its path (``None`` where
    the hook is off or it cannot be written). The caller removes it when its workers are gone."""
    if not PACKAGE_MAP.active():
        return None
    memoize()
    data = {"metadata": _metadata(), "map": importlib.metadata.packages_distributions()}
    try:
        fd, path = tempfile.mkstemp(prefix="xrlhf-packages-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
    except OSError:
        return None
    return path


def install(path: str | None = None) -> bool:
    """Answer ``packages_distributions`` from ``path`` (default: ``$XRLHF_PACKAGE_MAP``) in this
    process where it holds for this import path (the module's docstring); returns whether it
    does. Any problem with the file leaves the function as it was."""
    path = path or os.environ.get(ENV)
    if not path or not PACKAGE_MAP.active():
        return False
    try:
        with open(path) as f:
            data = json.load(f)
        saved, mapping = data["metadata"], data["map"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(mapping, dict) or saved != _metadata():
        return False
    importlib.metadata.packages_distributions = lambda: {k: list(v) for k, v in mapping.items()}
    return True


def cache_entry_points() -> None:
    """Answer ``importlib.metadata.entry_points(**selection)`` once per selection in this process
    (a worker: nothing is installed while it runs). Its answers are immutable."""
    if importlib.metadata.entry_points is not _ENTRY_POINTS or not ENTRY_POINTS.active():
        return
    cached = functools.lru_cache(maxsize=None)(lambda items: _ENTRY_POINTS(**dict(items)))

    @functools.wraps(_ENTRY_POINTS)
    def entry_points(**selection):
        return cached(tuple(sorted(selection.items())))

    importlib.metadata.entry_points = entry_points
