"""``benchmarks/generation.py --rounds`` and ``--passes`` on CPU, with a fake engine (no vLLM, no CUDA).

Rounds interleave the variants on one engine and each variant reports its median round; every
variant sets its logprobs path first, so vLLM alone and the worker-recorded path alternate in
one process.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from benchmarks import generation as gb


def test_every_variant_is_described_for_the_report():
    assert sorted(gb.VARIANT_NOTES) == sorted(gb.VARIANTS)


def test_interleaved_runs_every_variant_once_per_round():
    assert gb.interleaved(["a", "b"], 3) == [(1, "a"), (1, "b"), (2, "a"), (2, "b"), (3, "a"), (3, "b")]
    assert gb.interleaved(["a"], 1) == [(1, "a")]


def test_summarize_reports_the_median_round_and_the_spread():
    rounds = [{"seconds": s, "tokens_per_s": round(100 / s)} for s in (3.4, 2.3, 2.9)]
    out = gb.summarize(rounds)
    assert (out["seconds"], out["tokens_per_s"]) == (2.9, 34)  # the median round's figures, together
    assert (out["median_s"], out["min_s"], out["max_s"]) == (2.9, 2.3, 3.4) and out["rounds"] == rounds
    even = gb.summarize(rounds + [{"seconds": 2.5, "tokens_per_s": 40}])
    assert even["seconds"] == 2.5 and even["median_s"] == 2.7  # a real round; the median between two
    one = gb.summarize(rounds[:1])
    assert one["seconds"] == one["median_s"] == one["min_s"] == one["max_s"] == 3.4


class FakeEngine:
    """What the benchmark touches of ``VLLMGenerateEngine``: its logprobs path, ``_rpc``
    and the request loop's ``exclusive``; records whether the worker's sampler records."""

    def __init__(self, path: str = "worker"):
        self.logprobs_path = path
        self.recording = path == "worker"  # the engine installs the recording at start-up
        self.rpcs: list = []
        self.owned = False
        self._loop = SimpleNamespace(exclusive=self._exclusive)

    @contextmanager
    def _exclusive(self):
        self.owned = True
        yield
        self.owned = False

    def _rpc(self, method, *args):
        assert self.owned, "an RPC outside the request loop's exclusive"
        self.rpcs.append((method, *args))
        self.recording = bool(args[0]) if args else True
        return [self.recording]

    def generate(self, prompts, params, seeds=None):
        pass

    def shutdown(self):
        pass


def test_set_logprobs_path_toggles_the_recording_only_when_it_changes():
    engine = FakeEngine()
    gb.set_logprobs_path(engine, "worker")
    assert engine.rpcs == []
    gb.set_logprobs_path(engine, "outputs")
    gb.set_logprobs_path(engine, "outputs")
    gb.set_logprobs_path(engine, "worker")
    assert engine.rpcs == [("xrlhf_record_logprobs", False), ("xrlhf_record_logprobs", True)]
    assert engine.logprobs_path == "worker" and engine.recording


@pytest.mark.parametrize("start", ["worker", "outputs"])
def test_rounds_alternate_the_paths_and_write_after_every_variant(monkeypatch, start):
    engines, written, seen = [], [], []
    seconds = iter([3.0, 2.0, 2.5, 3.3, 2.4, 2.2])  # a, worker_b, a, worker_b, a, worker_b

    def fake_run(name):
        def run(engine, prompts, new_tokens, sampler):
            seen.append((name, engine.logprobs_path, engine.recording))
            return {"seconds": next(seconds), "tokens_per_s": 1}
        return run

    def fake_engine(model, n, memory, **fields):
        engines.append(FakeEngine(fields.get("logprobs_path", "worker")))
        return engines[-1], {**fields, "engine_options": {}}

    monkeypatch.setattr(gb, "VARIANTS", {"a": gb._outputs(fake_run("a")), "worker_b": gb._worker(fake_run("worker_b"))})
    monkeypatch.setattr(gb, "vllm_engine", fake_engine)
    monkeypatch.setattr(gb, "DeviceMemorySampler", lambda: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(gb, "write_json", lambda out, name, data: written.append(copy.deepcopy(data)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    args = SimpleNamespace(variants="a,worker_b", rounds=3, configs=json.dumps({"w": {"logprobs_path": start}}),
                           gpu_memory_utilization=0.3, new_tokens=4, out="unused", name="t")
    result = {"configs": {}}
    gb.config_pass(args, "model", [[1, 2]] * 4, "w", {"logprobs_path": start}, result, 1)  # run_configs' child

    assert seen == [("a", "outputs", False), ("worker_b", "worker", True)] * 3
    assert [r[1:] for r in engines[0].rpcs] == ([(False,), (True,)] if start == "worker" else [(True,)]) + \
        [(False,), (True,)] * 2
    assert len(written) == 6 and list(written[0]["configs"]["w"]["variants"]) == ["a"]  # a cut-off run keeps it
    variants = result["configs"]["w"]["variants"]
    assert (variants["a"]["seconds"], variants["a"]["min_s"], variants["a"]["max_s"]) == (2.5, 2.4, 3.0)
    assert variants["worker_b"]["median_s"] == 2.2 and len(variants["worker_b"]["rounds"]) == 3


class _PassEngine:
    def generate(self, prompts, params):
        return None

    def shutdown(self):
        pass


class _Sampler:
    def close(self):
        pass


def test_a_configurations_passes_pool_their_rounds(tmp_path, monkeypatch):
    """Pass 2 of a configuration adds its rounds to pass 1's: each round says its pass, the
    variant's figures are over all of them, and each pass's start-up is kept."""
    seconds = iter([3.0, 5.0, 4.0, 3.5])
    monkeypatch.setattr(gb, "VARIANTS", {"v": lambda engine, prompts, n, sampler: {"seconds": next(seconds)}})
    monkeypatch.setattr(gb, "vllm_engine", lambda model, n, memory, **fields: (_PassEngine(), {**fields}))
    monkeypatch.setattr(gb, "DeviceMemorySampler", _Sampler)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    args = SimpleNamespace(variants="v", rounds=2, gpu_memory_utilization=0.4, new_tokens=4, name="t", out=str(tmp_path))
    result = {"configs": {}}
    for n in (1, 2):
        gb.config_pass(args, "model", [[1, 2]], "a", {"enable_prefix_caching": False}, result, n)
    entry = json.loads((tmp_path / "generation-t.json").read_text())["configs"]["a"]
    v = entry["variants"]["v"]
    assert [(r["seconds"], r["pass"]) for r in v["rounds"]] == [(3.0, 1), (5.0, 1), (4.0, 2), (3.5, 2)]
    assert (v["median_s"], v["min_s"], v["max_s"]) == (3.75, 3.0, 5.0)
    assert len(entry["startup_s_passes"]) == 2 and entry["options"] == {"enable_prefix_caching": False}


def test_configurations_alternate_each_in_a_process_of_its_own(tmp_path):
    """A B A B, each pass a new process: here every one fails (no GPU), the run goes on to the next
    and then names them all; an older run's file is not read back as this run's."""
    (tmp_path / "generation-t.json").write_text(json.dumps({"configs": {"old": {}}}))
    args = SimpleNamespace(variants="raw_no_logprobs", rounds=1, passes=2, gpu_memory_utilization=0.4,
                           new_tokens=4, name="t", out=str(tmp_path), configs='{"a": {}, "b": {}}')
    result = {"configs": {}}
    with pytest.raises(SystemExit, match=r"a pass 1 \(exit 1\), b pass 1 \(exit 1\), a pass 2 \(exit 1\), "
                                         r"b pass 2 \(exit 1\)"):
        gb.run_configs(args, "no-model", [[1, 2]], result)
    assert result == {"configs": {}} and not (tmp_path / "generation-t.json").exists()
