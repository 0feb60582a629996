"""Models built locally from a few numbers, so tests and tutorials never download one.

See :mod:`xrlhf.models.tiny` (``xrlhf make-tiny-model DIR``).
"""

from xrlhf.models.tiny import PRESETS, build_model, build_tokenizer, count_params

__all__ = ["PRESETS", "build_model", "build_tokenizer", "count_params"]
