"""The standard library's import metadata, answered once: ``entry_points`` once per selection in a
worker.

``entry_points`` reads every installed distribution's entry points on each call; vLLM's plugin
loading calls it several times while its engine starts. A worker installs nothing while it runs, so
it keeps each answer (``cache_entry_points``).
"""

from __future__ import annotations

import functools
import importlib.metadata

from xrlhf.internals import Hook, needs

ENTRY_POINTS = Hook(
    "python.entry_points", "python", ("3.11", "3.12"),
    buys="a worker answers importlib.metadata.entry_points once per selection (vLLM asks while it starts)",
    without="each call reads every distribution's entry points",
    probe=needs("importlib.metadata", "entry_points"))

_ENTRY_POINTS = importlib.metadata.entry_points


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
