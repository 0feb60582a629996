"""The vLLM engine's request loop (``xrlhf.engines.vllm.loop``) on CPU, against the fake vLLM of
test_vllm_cpu.py: concurrent keyed calls, seeds, version stamps across a weight sync that lands
mid-generation (continue / recompute / abort), the plain ``LLM.generate`` path beside the loop,
errors and shutdown. The fake checks that no two threads are ever inside the ``LLM`` at once and
that weights never load while it generates. Control flow only: tests/gpu/test_vllm_inflight.py
runs the same protocol on a real vLLM.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.engines.test_vllm_cpu import (FakeLLM, engine_spec, fake_token, token_kv, token_weights,  # noqa: F401
                                         trained_weights, vllm_module)
from xrlhf.engines.base import SamplingParams
from xrlhf.utils.seeds import derive_seed
from xrlhf.weight_sync import WeightSyncError, build_transport, checksum, compare_checksums, push_weights

TIMEOUT = 20.0


def wait_until(predicate, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


class Caller(threading.Thread):
    """``engine.generate`` in a thread of its own (as Ray's rollout group runs it)."""

    def __init__(self, engine, *args):
        super().__init__(daemon=True)
        self.engine, self.args, self.out, self.error = engine, args, None, None
        self.start()

    def run(self):
        try:
            self.out = self.engine.generate(*self.args)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def result(self):
        self.join(TIMEOUT)
        assert not self.is_alive(), "generate hung"
        if self.error is not None:
            raise self.error
        return self.out


def sync(engine, weights, version: int, transport: str = "cpu") -> None:
    push_weights(build_transport(transport, bucket_bytes=20_000, verify=True), weights, engine.receive_weights)
    engine.end_sync(version)


@pytest.fixture()
def engine(vllm_module, tiny_model):
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model, sleep_level=0, seeded_sampling=True))
    yield engine
    engine.shutdown()
    assert not FakeLLM.last.violations


def test_derive_seed():
    assert derive_seed(7, 0) == 7
    seeds = {derive_seed(7, a) for a in range(1, 50)} | {derive_seed(8, 1)}
    assert len(seeds) == 50 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(7, 1) == derive_seed(7, 1)


def test_concurrent_keyed_calls_complete_with_their_rows_and_seeds(engine):
    llm = FakeLLM.last
    callers = {k: Caller(engine, [[1, 10 * k + j] for j in range(3)], SamplingParams(max_new_tokens=4 + k),
                         [100 * k + j for j in range(3)]) for k in range(8)}
    for k, caller in callers.items():
        out = caller.result()
        for j in range(3):
            want = [fake_token([10 * k + j], 0, 0, pos) for pos in range(4 + k)]
            assert out.token_ids[j] == want and out.logprobs[j] == [-t / 1e6 for t in want]
            assert out.versions[j] == [0] * (4 + k)
    seeds = {(tuple(prompt), seed) for _, prompt, seed, _ in llm.llm_engine.added}
    assert seeds == {((1, 10 * k + j), 100 * k + j) for k in range(8) for j in range(3)}
    assert {salt for *_, salt in llm.llm_engine.added} == {"xrlhf-0"}
    assert not any(c[0] == "generate" for c in llm.calls)  # LLM.generate never ran


@pytest.mark.parametrize("on_update,client", [("continue", "SyncMPClient"), ("recompute", "SyncMPClient"),
                                              ("abort", "SyncMPClient"), ("continue", "InprocClient")])
def test_a_sync_mid_generation_pauses_loads_and_stamps_versions(vllm_module, tiny_model, monkeypatch, on_update,
                                                                  client):
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model, sleep_level=0, seeded_sampling=True,
                                                        multiprocessing=client == "SyncMPClient"))
    llm = FakeLLM.last
    asked = threading.Event()

    def hold_step_3(n):  # the sync asks for the pause while step 3 runs
        if n == 3:
            asked.set()
            wait_until(lambda: engine._loop._pause == "asked")

    llm.llm_engine.on_step = hold_step_3
    caller = Caller(engine, [[1, 5], [1, 6]], SamplingParams(max_new_tokens=10, on_update=on_update, in_flight=True),
                    [7, 8])
    assert asked.wait(TIMEOUT), caller.error
    weights = trained_weights(tiny_model)
    sync(engine, weights, version=1, transport="in_process" if client == "InprocClient" else "cpu")
    out = caller.result()

    # vLLM's engine process runs ahead of the client: the token it sampled before the pause is
    # collected after it and keeps the old version (the fake's step 4, produced at the pause).
    switch = 3 if client == "InprocClient" else 4
    for row, prompt in zip(range(2), [5, 6]):
        tokens, versions = out.token_ids[row], out.versions[row]
        assert len(tokens) == 10 and versions == [token_weights(t) for t in tokens]  # the weights that sampled it
        if on_update == "abort":  # restarted from the prompt: one version per row
            assert tokens == [fake_token([prompt], 1, 1, pos) for pos in range(10)]
        else:
            kv = 1 if on_update == "recompute" else 0
            assert versions == [0] * switch + [1] * (10 - switch)
            assert [token_kv(t) for t in tokens[switch:]] == [kv] * (10 - switch)
    calls = llm.calls
    pause, first_load = calls.index(("sleep", 0, "keep")), calls.index(("rpc", "xrlhf_receive"))
    assert pause < first_load < calls.index(("rpc", "xrlhf_end_sync")) < calls.index(("wake_up", ["scheduling"]))
    assert (("reset_prefix_cache", True) in calls) == (on_update == "recompute")
    if on_update == "abort":
        restarted = [(p, s) for _, p, s, salt in llm.llm_engine.added if salt == "xrlhf-1"]
        assert restarted == [([1, 5], derive_seed(7, 1)), ([1, 6], derive_seed(8, 1))]
        assert len(llm.llm_engine.aborted) == 2
    compare_checksums({n: checksum(t) for n, t in weights}, engine.weight_checksums())  # verified where it landed
    engine.shutdown()
    assert not llm.violations, llm.violations


def test_a_sync_with_nothing_running_does_not_pause(engine, tiny_model):
    llm = FakeLLM.last
    engine.generate([[1, 5]], SamplingParams(max_new_tokens=3), [1])  # the loop runs, then idles
    llm.calls.clear()
    sync(engine, trained_weights(tiny_model), version=1)
    assert not any(c[0] == "sleep" or c == ("wake_up", ["scheduling"]) for c in llm.calls)
    out = engine.generate([[1, 5]], SamplingParams(max_new_tokens=3), [1])
    assert out.versions == [[1, 1, 1]] and [token_weights(t) for t in out.token_ids[0]] == [1, 1, 1]
    assert ("reset_prefix_cache",) in llm.calls  # old-weight prefixes dropped before the new requests
    assert llm.llm_engine.added[-1][3] == "xrlhf-1"  # and a new cache salt


def test_a_sync_received_in_another_thread_frees_the_engine_when_it_ends(engine, tiny_model):
    """A broadcast's receiver runs in a thread of its own (``push_weights``), so one thread begins
    the sync and another ends it; then the ``LLM`` is free again (on a GPU, NCCL from the other GPU
    hung in the checksum read-back that followed)."""
    engine.generate([[1, 5]], SamplingParams(max_new_tokens=3), [1])
    transport = build_transport("cpu", bucket_bytes=20_000, verify=True)
    weights = trained_weights(tiny_model)
    receiver = threading.Thread(target=lambda: [engine.receive_weights(transport, [m]) for m in transport.send(weights)])
    receiver.start()
    receiver.join(TIMEOUT)
    assert not receiver.is_alive()
    engine.end_sync(1)
    reader = Caller(engine, [[1, 5]], SamplingParams(max_new_tokens=2), [1])
    checksums = {}
    looker = threading.Thread(target=lambda: checksums.update(engine.weight_checksums()), daemon=True)
    looker.start()
    looker.join(TIMEOUT)
    assert not looker.is_alive(), "weight_checksums waited for a sync that had ended"
    compare_checksums({k: checksum(v) for k, v in weights}, checksums, "vLLM")
    assert reader.result().versions == [[1, 1]]


def test_unkeyed_generate_waits_for_the_loop_and_uses_llm_generate(engine):
    llm = FakeLLM.last
    started = threading.Event()
    llm.llm_engine.on_step = lambda n: (started.set(), time.sleep(0.002))
    keyed = Caller(engine, [[1, 5], [1, 6]], SamplingParams(max_new_tokens=20), [1, 2])
    assert started.wait(TIMEOUT)
    plain = engine.generate([[1, 5]], SamplingParams())  # the fake fails if the loop still had requests
    assert plain.token_ids == [[6, 7, 8]] and ("generate", 1) in llm.calls
    assert keyed.result().versions == [[0] * 20] * 2


def test_an_error_in_step_fails_every_waiting_call(engine):
    llm = FakeLLM.last
    gate = threading.Event()
    llm.llm_engine.fail_at = 3
    llm.llm_engine.on_step = lambda n: gate.wait(TIMEOUT)  # the first steps wait for every call to be queued
    callers = [Caller(engine, [[1, k]], SamplingParams(max_new_tokens=8), [k]) for k in range(3)]
    wait_until(lambda: len(engine._loop._pending) + len(engine._loop._running) == 3)
    gate.set()
    for caller in callers:
        with pytest.raises(RuntimeError, match="boom"):
            caller.result()
    with pytest.raises(RuntimeError, match="stopped after an error.*boom"):
        engine.generate([[1, 5]], SamplingParams(), [1])
    engine.generate([[1, 5]], SamplingParams())  # the plain path does not wait for a dead loop


def test_a_failed_sync_fails_the_paused_calls_and_frees_the_engine(engine, tiny_model):
    llm = FakeLLM.last
    asked = threading.Event()
    llm.llm_engine.on_step = lambda n: n == 2 and (asked.set(), wait_until(lambda: engine._loop._pause == "asked"))
    caller = Caller(engine, [[1, 5]], SamplingParams(max_new_tokens=10, in_flight=True), [1])
    assert asked.wait(TIMEOUT)
    transport = build_transport("cpu", verify=True)
    message = next(transport.send(trained_weights(tiny_model)))
    message.payload[message.meta["offsets"][3] + 5] ^= 4  # a corrupted byte: the worker refuses the bucket
    with pytest.raises(WeightSyncError):
        engine.receive_weights(transport, [message])
    with pytest.raises(RuntimeError, match="weight sync failed while this call was generating"):
        caller.result()
    llm.llm_engine.on_step = None
    assert engine.generate([[1, 5]], SamplingParams(max_new_tokens=2), [1]).token_ids == [[50000, 50001]]


def test_shutdown_fails_running_calls_and_joins_the_loop(engine):
    llm = FakeLLM.last
    engine.generate([[1, 5]], SamplingParams(max_new_tokens=2), [1])
    thread = engine._loop._thread
    assert thread.is_alive()
    llm.llm_engine.on_step = lambda n: wait_until(lambda: engine._loop._stopping)
    caller = Caller(engine, [[1, 5]], SamplingParams(max_new_tokens=10), [1])
    wait_until(lambda: engine._loop._running)
    engine.shutdown()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        caller.result()


def test_final_only_rows_restart_when_weights_land_anyway(vllm_module, tiny_model):
    """Without ``in_flight`` a call asks for final outputs only (no per-step host work); an update
    that lands mid-call restarts its rows, so every token still carries the version that sampled it."""
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model, sleep_level=0, seeded_sampling=True))
    llm = FakeLLM.last
    asked = threading.Event()
    llm.llm_engine.on_step = lambda n: n == 3 and (asked.set(), wait_until(lambda: engine._loop._pause == "asked"))
    caller = Caller(engine, [[1, 5], [1, 6]], SamplingParams(max_new_tokens=10), [7, 8])
    assert asked.wait(TIMEOUT), caller.error
    sync(engine, trained_weights(tiny_model), version=1, transport="cpu")
    out = caller.result()
    assert all(p.output_kind == "FINAL_ONLY" for p in (r.params for r in llm.llm_engine.requests.values()))
    for row, prompt in zip(range(2), [5, 6]):
        assert out.versions[row] == [1] * 10
        assert out.token_ids[row] == [fake_token([prompt], 1, 1, pos) for pos in range(10)]
    engine.shutdown()
    assert not llm.violations, llm.violations
