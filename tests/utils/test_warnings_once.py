"""``utils.warnings_once``: a library's warning is one line, once per process."""

from __future__ import annotations

import logging
import warnings

from loguru import logger

from xrlhf.utils.warnings_once import one_line_warnings


def test_each_warning_is_one_line_once():
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    py_warnings = logging.getLogger("py.warnings")
    handlers, propagate = list(py_warnings.handlers), py_warnings.propagate
    try:
        handler = one_line_warnings()
        handler.seen.clear()
        assert one_line_warnings() is handler  # once per process
        with warnings.catch_warnings():
            # pytest puts its own ``showwarning`` back around each test: capture again inside
            logging.captureWarnings(False)
            logging.captureWarnings(True)
            warnings.simplefilter("always")
            for _ in range(3):
                warnings.warn("`past_key_values` is deprecated\n  use `cache`", FutureWarning, stacklevel=1)
            warnings.warn("another one", DeprecationWarning, stacklevel=1)
    finally:
        logger.remove(sink)
        logging.captureWarnings(False)
        py_warnings.handlers[:] = handlers
        py_warnings.propagate = propagate
    assert len(lines) == 2, lines
    assert lines[0].startswith("FutureWarning (test_warnings_once:")
    assert lines[0].rstrip().endswith("`past_key_values` is deprecated use `cache`")
    assert lines[1].startswith("DeprecationWarning (") and "another one" in lines[1]
