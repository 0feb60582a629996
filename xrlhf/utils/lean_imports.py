"""A worker's import of transformers without scikit-learn, where transformers would import it eagerly.

Transformers before 5.24 imports scikit-learn (and with it ``scipy.stats``) when its generation
package loads, whenever scikit-learn is installed (``generation/candidate_generator.py``: its
``roc_curve``, for assisted generation's confidence threshold). Every process that imports
transformers pays for it: 1.3-1.8 s under cProfile in each worker of W's warm start on the GPU
machine (transformers 5.17), ~0.7 s of the generator's vLLM import, which is the start's
critical path. Transformers 5.24 imports it where it is used.

No engine of xrlhf uses assisted generation, so a worker tells transformers that scikit-learn is
absent before transformers loads it; scikit-learn itself stays importable (a reward function that
imports it gets it). ``XRLHF_KEEP_SKLEARN=1`` keeps transformers' own answer.

Also: ``importlib.metadata.entry_points`` reads every installed distribution's entry points on
each call; vLLM's plugin loading calls it 8 times while its engine starts (0.46 s under cProfile).
A worker installs nothing while it runs, so it keeps each answer (``cache_entry_points``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys

KEEP_ENV = "XRLHF_KEEP_SKLEARN"
EAGER_BEFORE = (5, 24)
"""Transformers versions below this import scikit-learn with their generation package."""


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def transformers_without_sklearn() -> bool:
    """Before transformers loads its generation package in this process: report scikit-learn as
    absent to transformers where its import would be eager. Returns whether it did; ``False``
    where it is asked not to, transformers is new enough or absent, scikit-learn is absent or
    already imported, or transformers' generation package is already loaded."""
    if os.environ.get(KEEP_ENV) or "sklearn" in sys.modules or "transformers.generation" in sys.modules:
        return False
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return False
    if _version(version) >= EAGER_BEFORE or importlib.util.find_spec("sklearn") is None:
        return False
    import transformers.utils as utils  # the package's utilities only: its models load lazily
    import transformers.utils.import_utils as import_utils

    def absent() -> bool:
        return False

    utils.is_sklearn_available = absent  # what `from ..utils import is_sklearn_available` binds
    import_utils.is_sklearn_available = absent
    return True


_ENTRY_POINTS = importlib.metadata.entry_points


def cache_entry_points() -> None:
    """Answer ``importlib.metadata.entry_points(**selection)`` once per selection in this process
    (a worker: nothing is installed while it runs). Its answers are immutable."""
    if importlib.metadata.entry_points is not _ENTRY_POINTS:
        return
    cached = functools.lru_cache(maxsize=None)(lambda items: _ENTRY_POINTS(**dict(items)))

    @functools.wraps(_ENTRY_POINTS)
    def entry_points(**selection):
        return cached(tuple(sorted(selection.items())))

    importlib.metadata.entry_points = entry_points
