"""``internals.imports`` (the hook ``python.package_map``): a worker answers ``importlib.metadata.packages_distributions`` from the
driver's file, the same answer, and only where the import path holds the same distributions."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest

from xrlhf.internals import imports as package_map


@pytest.fixture
def restored(monkeypatch):
    """``packages_distributions`` put back as it was after the test (``install`` replaces it)."""
    monkeypatch.setattr(importlib.metadata, "packages_distributions", package_map.ORIGINAL)
    paths: list[str] = []
    yield paths
    for p in paths:
        os.remove(p)


def test_a_worker_gets_the_drivers_answer(restored):
    path = package_map.share()
    restored.append(path)
    importlib.metadata.packages_distributions = package_map.ORIGINAL  # a fresh process
    assert package_map.install(path) is True
    assert importlib.metadata.packages_distributions is not package_map.ORIGINAL
    assert importlib.metadata.packages_distributions() == package_map.ORIGINAL()
    # each call gets its own lists (transformers' callers may keep and change them)
    importlib.metadata.packages_distributions()["torch"].append("x")
    assert "x" not in importlib.metadata.packages_distributions()["torch"]


def test_a_distribution_the_driver_did_not_see_is_not_hidden(restored, tmp_path, monkeypatch):
    path = package_map.share()
    restored.append(path)
    (tmp_path / "extra_pkg-1.0.dist-info").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.metadata.packages_distributions = package_map.ORIGINAL
    assert package_map.install(path) is False
    assert importlib.metadata.packages_distributions is package_map.ORIGINAL


def test_a_package_installed_since_is_not_hidden(restored, tmp_path, monkeypatch):
    (tmp_path / "extra_pkg-1.0.dist-info").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    path = package_map.share()
    restored.append(path)
    importlib.metadata.packages_distributions = package_map.ORIGINAL
    (tmp_path / "extra_pkg-1.0.dist-info").rename(tmp_path / "extra_pkg-1.1.dist-info")  # an upgrade
    assert package_map.install(path) is False
    (tmp_path / "extra_pkg-1.1.dist-info").rename(tmp_path / "extra_pkg-1.0.dist-info")
    (tmp_path / "run-output").mkdir()  # other entries of a directory on the path do not matter
    assert package_map.install(path) is True


def test_no_file_or_a_broken_one_changes_nothing(restored, tmp_path, monkeypatch):
    monkeypatch.delenv(package_map.ENV, raising=False)
    assert package_map.install() is False
    assert package_map.install(str(tmp_path / "missing.json")) is False
    (tmp_path / "broken.json").write_text("{not json")
    assert package_map.install(str(tmp_path / "broken.json")) is False
    for text in ('{"metadata": {}}', '{"metadata": {}, "map": []}', '[1, 2]'):
        (tmp_path / "other.json").write_text(text)
        assert package_map.install(str(tmp_path / "other.json")) is False
    assert importlib.metadata.packages_distributions is package_map.ORIGINAL


def test_the_drivers_answer_is_computed_once(restored):
    package_map.memoize()
    first = importlib.metadata.packages_distributions()
    assert importlib.metadata.packages_distributions() is first
    package_map.memoize()  # again: no second wrapper
    assert importlib.metadata.packages_distributions() is first
