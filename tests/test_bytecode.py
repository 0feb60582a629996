"""``utils.bytecode``: which packages Python would compile from source in every new process."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import sys

from xrlhf.utils import bytecode


def test_a_pyc_counts_while_it_matches_its_source(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "pycache_prefix", None)
    src = tmp_path / "mod.py"
    src.write_text("X = 1\n")
    assert not bytecode.valid_pyc(src)  # none yet
    py_compile.compile(str(src))
    assert bytecode.valid_pyc(src)
    st = src.stat()
    os.utime(src, (st.st_atime, st.st_mtime + 10))  # the source changed after its compile: stale
    assert not bytecode.valid_pyc(src)
    py_compile.compile(str(src), invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    assert bytecode.valid_pyc(src)
    pyc = importlib.util.cache_from_source(str(src))
    with open(pyc, "r+b") as f:  # another interpreter's bytecode
        f.write(b"\0\0\0\0")
    assert not bytecode.valid_pyc(src)


def test_a_package_without_bytecode_is_named_with_the_fix(tmp_path, monkeypatch):
    pkg = tmp_path / "bigpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))  # an empty cache tree
    assert bytecode.uncompiled(("bigpkg", "no_such_package_here")) == ["bigpkg"]
    line = bytecode.warning(["bigpkg"])
    assert "bigpkg" in line and "PYTHONPYCACHEPREFIX" in line and str(tmp_path) in line
    py_compile.compile(str(pkg / "__init__.py"))  # into the prefix: Python would read it there
    assert bytecode.uncompiled(("bigpkg",)) == []

