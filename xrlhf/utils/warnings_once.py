"""Other libraries' warnings as one line each, once per process.

Python prints a warning as two lines (the file and line that raised it, then the source line),
once per place that raises it; a run's workers are processes of their own, so one deprecation
inside transformers read as dozens of lines in a quickstart's console. Here the warnings go to
the standard library's ``py.warnings`` logger (``logging.captureWarnings``) and from there each
distinct (category, message) becomes one loguru line, ``<Category> (<module>:<line>): <message>``,
the first time; Ray's log deduplication then folds the workers' copies into one.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from loguru import logger

_FORMATTED = re.compile(r"(?s)(?P<file>.*?):(?P<line>\d+): (?P<category>\w+): (?P<message>.*)")
"""``warnings.formatwarning``'s text: ``file:line: Category: message`` then the source line."""


class _OneLine(logging.Handler):
    """Each distinct warning once, as one loguru line."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        m = _FORMATTED.match(text)
        if m is None:
            category, where, message = "Warning", "", text
        else:
            lines = m["message"].rstrip("\n").split("\n")
            if len(lines) > 1 and lines[-1].startswith("  "):  # the source line warnings adds
                lines = lines[:-1]
            category, where, message = m["category"], f"{Path(m['file']).stem}:{m['line']}", "\n".join(lines)
        key = (category, message)
        if key in self.seen:
            return
        self.seen.add(key)
        logger.warning(f"{category} ({where}): {' '.join(message.split())}")


def one_line_warnings() -> logging.Handler:
    """Route this process's warnings through :class:`_OneLine` (once per process); returns the handler."""
    logging.captureWarnings(True)
    py_warnings = logging.getLogger("py.warnings")
    for h in py_warnings.handlers:
        if isinstance(h, _OneLine):
            return h
    handler = _OneLine()
    py_warnings.addHandler(handler)
    py_warnings.propagate = False
    return handler
