"""The worker set-up hook (``engines.host.SETUP_ENV``) and the diagnostics the benchmarks run through it
(``benchmarks.common.worker_diagnostics``): engine builds under cProfile, the collector's log."""

import gc
import json

import pytest
import yaml

from benchmarks.common import GC_LOG_ENV, PROFILE_ENV, diagnostics_env, log_gc, profiler
from xrlhf.engines.base import DistInfo, EngineSpec
from xrlhf.cli import main
from xrlhf.engines.host import SETUP_ENV, EngineHost
from xrlhf.utils.errors import UserError


def _build_something(n: int) -> int:
    return sum(i * i for i in range(n))


def test_without_the_variable_a_host_calls_its_builds_directly(monkeypatch):
    monkeypatch.delenv(SETUP_ENV, raising=False)
    host = EngineHost("policy", 0)
    assert host.around("policy-0-train", _build_something, 10) == 285


def test_a_real_build_runs_under_the_profiler_the_variables_name(tiny_model, tmp_path, monkeypatch):
    for k, v in diagnostics_env(profile_dir=str(tmp_path / "prof")).items():
        monkeypatch.setenv(k, v)
    host = EngineHost("reference", 0)
    host.setup({"infer": ("hf", EngineSpec(tiny_model, options={"micro_batch_size": 4}))}, DistInfo())
    assert host.infer_engine is not None
    text = (tmp_path / "prof" / "reference-0-infer.txt").read_text()
    assert "build_engine" in text and "cumulative" in text


def test_a_name_that_does_not_resolve_is_one_line_naming_the_variable(base_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(SETUP_ENV, "benchmarks.common:no_such_function")
    with pytest.raises(UserError, match=f"^{SETUP_ENV}=benchmarks.common:no_such_function: cannot load it"):
        EngineHost("policy", 0)
    # xrlhf run and validate say so before anything starts: one line, exit status 2
    monkeypatch.setenv(SETUP_ENV, "no_such_module:setup")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config))
    assert main(["validate", str(tmp_path / "cfg.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {SETUP_ENV}=no_such_module:setup: cannot load it (No module named 'no_such_module'); "
                   "name an importable module:function or unset it"]


def test_a_failing_build_still_leaves_its_tables(tmp_path):
    def broken() -> None:
        raise ValueError("no model there")

    with pytest.raises(ValueError, match="no model there"):
        profiler(str(tmp_path))("rollout-0-generate", broken)
    assert "broken" in (tmp_path / "rollout-0-generate.txt").read_text()


def test_an_unwritable_folder_loses_only_the_tables(tmp_path):
    (tmp_path / "a-file").write_text("")
    around = profiler(str(tmp_path / "a-file" / "prof"))  # under a file: cannot be made
    assert around("policy-0-train", _build_something, 10) == 285


def test_the_collector_log_has_a_row_per_collection(tmp_path, monkeypatch):
    monkeypatch.setenv(GC_LOG_ENV, str(tmp_path))
    callback = log_gc(str(tmp_path), "policy-0")
    try:
        for _ in range(64):  # a batch of 64 is written at once
            gc.collect(0)
    finally:
        gc.callbacks.remove(callback)
    (path,) = tmp_path.glob("gc-policy-0-*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(end >= start for start, end, _, _ in rows)
    assert sum(gen == 0 for _, _, gen, _ in rows) >= 64  # automatic collections may come between


def test_the_switches_name_the_hook(tmp_path):
    env = diagnostics_env(str(tmp_path / "p"), str(tmp_path / "g"))
    assert env == {SETUP_ENV: "benchmarks.common:worker_diagnostics", PROFILE_ENV: str(tmp_path / "p"),
                   GC_LOG_ENV: str(tmp_path / "g")}
