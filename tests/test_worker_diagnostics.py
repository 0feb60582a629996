"""``engines.host.profiled``: a build under cProfile where ``XRLHF_PROFILE_SETUP`` names a folder."""

import pytest

from xrlhf.engines.host import PROFILE_ENV, profiled


def _build_something(n: int) -> int:
    return sum(i * i for i in range(n))


def test_without_the_variable_the_call_runs_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert profiled("policy-0-train", _build_something, 10) == 285
    assert list(tmp_path.iterdir()) == []


def test_with_the_variable_the_tables_name_the_call(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "prof"))
    assert profiled("policy-0-train", _build_something, 10) == 285
    text = (tmp_path / "prof" / "policy-0-train.txt").read_text()
    assert "_build_something" in text and "cumulative" in text


def test_a_failing_build_still_leaves_its_tables(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))

    def broken() -> None:
        raise ValueError("no model there")

    with pytest.raises(ValueError, match="no model there"):
        profiled("rollout-0-generate", broken)
    assert "broken" in (tmp_path / "rollout-0-generate.txt").read_text()


def test_an_unwritable_folder_loses_only_the_tables(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "a-file" / "prof"))  # under a file: cannot be made
    assert profiled("policy-0-train", _build_something, 10) == 285
