"""Other libraries' warnings as one line each, once per process.

Python prints a warning as two lines (the file and line that raised it, then the source line),
once per place that raises it; a run's workers are processes of their own, so one deprecation
inside transformers read as dozens of lines in a quickstart's console. Here each distinct
(category, message) is one loguru line, ``<Category> (<module>): <message>``, the first time;
Ray's log deduplication then folds the workers' copies into one.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from loguru import logger

_SEEN: set[tuple[str, str]] = set()


def _show(message, category, filename, lineno, file=None, line=None) -> None:
    key = (category.__name__, str(message))
    if key in _SEEN:
        return
    _SEEN.add(key)
    text = " ".join(str(message).split())
    logger.opt(depth=2).warning(f"{category.__name__} ({Path(filename).stem}:{lineno}): {text}")


def one_line_warnings() -> None:
    """Route this process's warnings through :func:`_show` (``warnings.showwarning`` is the
    standard library's documented hook for it)."""
    warnings.showwarning = _show
