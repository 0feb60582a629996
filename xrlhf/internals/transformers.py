"""Transformers' internals: the attention a model runs, and an import without scikit-learn."""

from __future__ import annotations

import importlib.util
import sys

from xrlhf.internals import Hook, needs
from xrlhf.utils.versions import installed, release

ATTENTION = Hook(
    "transformers.attn_implementation", "transformers", ("5.17", "5.24"),
    buys="the attention implementation transformers chose for a model (config._attn_implementation: "
         "no public getter), so packing keeps a flash model's own varlen path",
    without="xrlhf assumes transformers' default (sdpa) unless it set the attention itself",
    probe=needs("transformers", "PretrainedConfig._attn_implementation"))

MARK = "xrlhf_attention"
"""The attribute ``set_attention`` leaves on a model (a plain attribute: no weight, not saved)."""


def set_attention(module, name: str) -> None:
    """``module.set_attn_implementation(name)`` (public), remembered for ``attention_of``."""
    module.set_attn_implementation(name)
    setattr(module, MARK, name)


def attention_of(module) -> str:
    """The attention implementation a transformers model runs (``"eager"`` when unset)."""
    if ATTENTION.active():
        return getattr(module.config, "_attn_implementation", None) or "eager"
    return getattr(module, MARK, "sdpa")


EAGER_SKLEARN_BEFORE = (5, 24)
"""Transformers releases below this import scikit-learn with their generation package."""


WITHOUT_SKLEARN = Hook(
    "transformers.without_sklearn", "transformers", ("5.17", "5.23"),
    buys="a worker's transformers import skips scikit-learn and scipy.stats (loaded for assisted "
         "generation, which no engine uses; transformers 5.24 loads them lazily)",
    without="transformers imports scikit-learn in every worker where it is installed",
    probe=needs("transformers.utils.import_utils", "is_sklearn_available"))


def import_without_sklearn() -> bool:
    """Before transformers loads its generation package in this process: report scikit-learn as
    absent to transformers where its import would be eager (scikit-learn itself stays importable:
    a reward function that imports it gets it). Returns whether it did; ``False`` where the hook is
    off, transformers is new enough or absent, scikit-learn is absent or already imported, or
    transformers' generation package is already loaded."""
    if "sklearn" in sys.modules or "transformers.generation" in sys.modules:
        return False
    version = installed("transformers")
    if version is None or release(version) >= EAGER_SKLEARN_BEFORE or importlib.util.find_spec("sklearn") is None:
        return False
    if not WITHOUT_SKLEARN.active():
        return False
    import transformers.utils as utils  # the package's utilities only: its models load lazily
    import transformers.utils.import_utils as import_utils

    def absent() -> bool:
        return False

    utils.is_sklearn_available = absent  # what `from ..utils import is_sklearn_available` binds
    import_utils.is_sklearn_available = absent
    return True
