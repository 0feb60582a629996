"""``importlib.metadata.packages_distributions()`` once per run, not once per process.

transformers calls it when imported (5.17: at module level) to map import names to
distributions. It reads the file list of every installed distribution that has no
``top_level.txt`` and stats each file: ~35,000 stats, 2.2-2.4 s of W's warm start under cProfile
on the GPU machine (2026-11-27), paid by the driver and again by every worker, the generator's
before vLLM's import can finish. The driver keeps its answer (``memoize``) and writes it to a
file (``share``); each worker reads it before it imports transformers (``install``, from
``coordinator/worker.py``).

It is the same answer only where the same distributions are found. The file records the
distribution metadata on the driver's import path (each directory's ``*.dist-info`` and
``*.egg-info`` names, versions in them); ``install`` uses the file only where the worker's import
path finds exactly those. (A worker's path lists some directories twice, so its own answer would
name their distributions twice: the same distributions.) Elsewhere (another node of a cluster, a
package installed meanwhile) the worker computes the map itself, as before.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import sys
import tempfile

ENV = "XRLHF_PACKAGE_MAP"
"""The file ``share`` wrote, set in the workers' environment by ``coordinator.init_ray``."""

_ORIGINAL = importlib.metadata.packages_distributions


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
    if importlib.metadata.packages_distributions is _ORIGINAL:
        importlib.metadata.packages_distributions = functools.cache(_ORIGINAL)


def share() -> str | None:
    """Write this process's map and import path to a new file; returns its path (``None`` where
    it cannot be written). The caller removes it when its workers are gone."""
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
    if not path:
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
