"""``utils.warnings_once``: a library's warning is one line, once per process."""

from __future__ import annotations

import warnings

from loguru import logger

from xrlhf.utils import warnings_once


def test_each_warning_is_one_line_once(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # set back afterwards
    monkeypatch.setattr(warnings_once, "_SEEN", set())
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    try:
        warnings_once.one_line_warnings()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for _ in range(3):
                warnings.warn("`past_key_values` is deprecated\n  use `cache`", FutureWarning, stacklevel=1)
            warnings.warn("another one", DeprecationWarning, stacklevel=1)
    finally:
        logger.remove(sink)
    assert len(lines) == 2
    assert lines[0].startswith("FutureWarning (test_warnings_once:")
    assert lines[0].rstrip().endswith("`past_key_values` is deprecated use `cache`")
    assert lines[1].startswith("DeprecationWarning (") and "another one" in lines[1]
