"""Logprobs kept in vLLM's worker (``policy.generate.logprobs_path: worker``, internals/vllm_record.py)
on CPU.

First the record itself, driven as vLLM's V2 model runner drives its sampler: slots handed out
as vLLM hands them out (a freed slot is the next one taken), ``add_request`` for every request
scheduled anew (a resumed one too), ``sample`` once per step with the position of each row's
last input token. Then the engine against the fake vLLM of test_vllm_cpu.py: both paths return
the same logprobs, through ``LLM.generate`` and through the request loop, a restarted row's
stale record is dropped, and ``SamplingParams.logprobs=False`` asks vLLM for none.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tests.engines.test_vllm_cpu import FakeLLM, FakeSampler, engine_spec, trained_weights, vllm_module  # noqa: F401
from tests.engines.test_vllm_loop import TIMEOUT, Caller, sync, wait_until
from xrlhf.engines.base import SamplingParams
from xrlhf.internals.vllm_record import MAX_SAVED_PER_SLOT, LogprobRecord, external_id, install, uninstall

VOCAB = 13


class FakeSampler033(FakeSampler):
    """vLLM 0.33's V2 ``Sampler`` signatures: the prompt's length is in the request states, and
    ``sample`` takes ``idx_mapping`` before ``idx_mapping_np`` and ``seq_lens_upper_bound_np`` after."""

    def __init__(self, slots: int = 8):
        super().__init__()
        self.req_states.prompt_len = SimpleNamespace(np=[0] * slots)

    def add_request(self, req_idx, sampling_params):
        self.params[req_idx] = sampling_params

    def sample(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos,
               seq_lens_upper_bound_np, return_logprobs=False):
        return logits.argmax(-1), logits


class MiniRunner:
    """The parts of vLLM's V2 ``GPUModelRunner`` the record touches, with its slot discipline, as
    vLLM 0.25 (``base=FakeSampler``) or 0.33 (``FakeSampler033``) calls its sampler."""

    def __init__(self, slots: int, base: type = FakeSampler):
        self.base = base
        self.sampler = base() if base is FakeSampler else base(slots)
        self.max_num_reqs = slots
        self.speculator = None
        self.free = list(range(slots))  # RequestState.free_indices: pop() takes the last freed
        self.slot: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.outputs: dict[str, list[float]] = {}  # what the sampler's logprob was, per output index
        self.gen = torch.Generator().manual_seed(0)

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        slot = self.free.pop()
        self.slot[rid] = slot
        self.sampler.req_states.index_to_req_id[slot] = f"{rid}-1a2b3c4d"  # vLLM's internal id
        if self.base is FakeSampler:
            self.sampler.add_request(slot, prompt_len, SimpleNamespace(max_tokens=max_tokens))
        else:  # 0.33: the runner writes the prompt's length into the request states first
            self.sampler.req_states.prompt_len.np[slot] = prompt_len
            self.sampler.add_request(slot, sampling_params=SimpleNamespace(max_tokens=max_tokens))
        self.prompt[rid] = prompt_len
        self.outputs.setdefault(rid, [])

    def remove(self, rid: str) -> None:  # finished or preempted: the slot is free again
        slot = self.slot.pop(rid)
        del self.sampler.req_states.index_to_req_id[slot]
        self.free.append(slot)

    def step(self, rids: list[str], discard: tuple[str, ...] = ()) -> None:
        """One sample for each of ``rids``; those in ``discard`` are in-flight samples vLLM drops."""
        logits = torch.randn(len(rids), VOCAB, generator=self.gen)
        pos = torch.tensor([self.prompt[r] + len(self.outputs[r]) - 1 for r in rids])
        idx = torch.tensor([self.slot[r] for r in rids], dtype=torch.int32)
        if self.base is FakeSampler:
            self.sampler.sample(logits, idx, idx.numpy(), pos, None, None)
        else:
            self.sampler.sample(logits, idx, idx, idx.numpy(), pos, None, None, None)
        want = torch.log_softmax(logits, -1).gather(-1, logits.argmax(-1, keepdim=True))[:, 0]
        for r, lp in zip(rids, want.tolist()):
            if r not in discard:
                self.outputs[r].append(lp)

    def take(self, rids: list[str]) -> list[list[float]]:
        lengths = [len(self.outputs[r]) for r in rids]
        flat = self.sampler._xrlhf_record.take(rids, lengths).tolist()
        ends = torch.tensor(lengths).cumsum(0).tolist()
        return [flat[e - n:e] for n, e in zip(lengths, ends)]


@pytest.fixture(params=[FakeSampler, FakeSampler033], ids=["vllm0.25", "vllm0.33"])
def runner(request):
    r = MiniRunner(slots=3, base=request.param)
    install(r, torch.device("cpu"), base=request.param)
    return r


def test_install_turns_the_sampler_into_a_recording_one_once(runner):
    record = runner.sampler._xrlhf_record
    assert type(runner.sampler).__name__ == f"Recording{runner.base.__name__}" and isinstance(runner.sampler, FakeSampler)
    assert not runner.sampler.use_flashinfer and record.slots == 3
    assert install(runner, torch.device("cpu"), base=runner.base) is record


def test_uninstall_gives_vllm_its_sampler_back_and_install_records_again(runner):
    first = runner.sampler._xrlhf_record
    runner.add("a", prompt_len=2, max_tokens=3)
    runner.step(["a"])
    assert uninstall(runner) and not uninstall(runner)  # the second: nothing to undo
    assert type(runner.sampler) is runner.base and runner.sampler.use_flashinfer
    assert not hasattr(runner.sampler, "_xrlhf_record")
    held = first.buf.clone()
    runner.remove("a")
    runner.add("b", prompt_len=2, max_tokens=3)  # vLLM's own sampler: nothing claimed, nothing written
    runner.step(["b"])
    assert torch.allclose(first.buf, held, equal_nan=True)
    assert list(first.slot_of) == ["a"]
    runner.remove("b")

    record = install(runner, torch.device("cpu"), base=runner.base)
    assert record is not first and type(runner.sampler).__name__ == f"Recording{runner.base.__name__}"
    assert not runner.sampler.use_flashinfer and not record.slot_of and not record.saved
    runner.add("c", prompt_len=4, max_tokens=2)
    runner.step(["c"])
    runner.step(["c"])
    assert runner.take(["c"]) == [runner.outputs["c"]]
    assert uninstall(runner) and runner.sampler.use_flashinfer
    runner.sampler.use_flashinfer = False  # a GPU without FlashInfer: it stays off after a round trip
    install(runner, torch.device("cpu"), base=runner.base)
    assert uninstall(runner) and runner.sampler.use_flashinfer is False


@pytest.mark.parametrize("sampler,speculator", [(object(), None), (FakeSampler(), object())])
def test_install_refuses_what_it_cannot_hook(sampler, speculator):
    other = SimpleNamespace(sampler=sampler, speculator=speculator, max_num_reqs=2)
    with pytest.raises(RuntimeError, match="logprobs_path: 'worker' needs vLLM's V2 model runner"):
        install(other, torch.device("cpu"), base=FakeSampler)


def test_every_token_keeps_its_logprob_across_reused_slots(runner):
    lengths = {"a": 5, "b": 2, "c": 7, "d": 3, "e": 4}
    waiting, running = list(lengths), []
    while waiting or running:
        while waiting and runner.free:
            rid = waiting.pop(0)
            runner.add(rid, prompt_len=3 + len(rid) + ord(rid) % 4, max_tokens=lengths[rid])
            running.append(rid)
        runner.step(running)
        for rid in [r for r in running if len(runner.outputs[r]) == lengths[r]]:
            running.remove(rid)
            runner.remove(rid)  # its row stays in the slot until the next request takes it
    keys = ["e", "a", "d", "c", "b"]
    got = runner.take(keys)
    assert got == [runner.outputs[k] for k in keys]  # the same float32 arithmetic: exact
    record = runner.sampler._xrlhf_record
    assert not record.saved and not record.slot_of and record.owner == [None] * 3
    with pytest.raises(RuntimeError, match="no record of 5 tokens for request 'a'"):
        record.take(["a"], [5])


def test_a_preempted_request_resumes_and_its_discarded_step_is_written_again(runner):
    runner.add("a", prompt_len=4, max_tokens=6)
    for _ in range(3):
        runner.step(["a"])
    runner.step(["a"], discard=("a",))  # in flight when vLLM preempted it: written, then discarded
    runner.remove("a")
    runner.add("b", prompt_len=2, max_tokens=3)  # takes a's slot: a's row is moved aside
    runner.add("c", prompt_len=5, max_tokens=2)
    runner.step(["b", "c"])
    runner.add("a", prompt_len=4, max_tokens=6)  # resumed in the third slot, output index 3 again
    for _ in range(3):
        runner.step(["a", "b"] if len(runner.outputs["b"]) < 3 else ["a"])
    assert runner.take(["a"]) == [runner.outputs["a"]]
    assert len(runner.outputs["a"]) == 6


def test_samples_outside_a_requests_outputs_are_not_recorded(runner):
    record = runner.sampler._xrlhf_record
    runner.add("a", prompt_len=6, max_tokens=2)
    # a prefill chunk (its sample is thrown away) and an in-flight step past the last output
    record.write(torch.tensor([-9.0, -8.0]), torch.tensor([runner.slot["a"]] * 2), torch.tensor([3, 6 + 40]))
    runner.step(["a"])
    runner.step(["a"])
    assert runner.take(["a"]) == [runner.outputs["a"]]
    runner.add("z", prompt_len=1, max_tokens=2)
    runner.step(["z"])
    with pytest.raises(RuntimeError, match="'z' has tokens without a recorded logprob"):
        record.take(["z"], [2])


def test_the_buffer_grows_with_max_tokens_and_keeps_what_it_held(runner):
    record = runner.sampler._xrlhf_record
    runner.add("a", prompt_len=2, max_tokens=3)
    runner.step(["a"])
    runner.add("b", prompt_len=2, max_tokens=record.width + 30)
    for _ in range(record.width):
        runner.step(["a", "b"] if len(runner.outputs["a"]) < 3 else ["b"])
    assert runner.take(["b", "a"]) == [runner.outputs["b"], runner.outputs["a"]]


def test_forgotten_and_untaken_rows_do_not_pile_up():
    record = LogprobRecord(slots=2, device="cpu", width=4)
    record.claim(0, "x", 1, 4)
    record.forget(["x", "never-seen"])
    assert not record.slot_of and record.owner == [None, None]
    for i in range(MAX_SAVED_PER_SLOT * 2 + 5):  # requests whose calls failed: moved aside, never taken
        record.claim(i % 2, f"r{i}", 1, 4)
    assert len(record.saved) <= MAX_SAVED_PER_SLOT * 2 and record.dropped > 0
    with pytest.raises(RuntimeError, match="rows dropped untaken"):
        record.take(["r0"], [1])


def test_external_id(monkeypatch):
    assert external_id("xrlhf-3-0-1-1a2b3c4d") == "xrlhf-3-0-1" and external_id("17-1a2b3c4d") == "17"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert external_id("xrlhf-3-0-1") == "xrlhf-3-0-1"


# -- the engine, against the fake vLLM -------------------------------------------------------------
def test_the_worker_path_returns_what_vllms_outputs_would(vllm_module, tiny_model):
    prompts = [[1, 5], [1, 6], [1, 7]]
    outputs = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model, sleep_level=0))
    worker = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model, sleep_level=0, logprobs_path="worker"))
    llm = FakeLLM.last
    assert ("rpc", "xrlhf_record_logprobs") in llm.calls
    assert worker.sampling_params(SamplingParams(), 1).logprobs is None  # vLLM is asked for none
    for seeds in (None, [3, 4, 5]):
        want, got = outputs.generate(prompts, SamplingParams(max_new_tokens=4), seeds), \
            worker.generate(prompts, SamplingParams(max_new_tokens=4), seeds)
        assert got.token_ids == want.token_ids and [len(x) for x in got.logprobs] == [len(x) for x in want.logprobs]
        assert sum(got.logprobs, []) == pytest.approx(sum(want.logprobs, []), rel=1e-6)
    record = llm.worker.model_runner.sampler._xrlhf_record
    assert not record.saved and not record.slot_of  # everything taken
    for engine in (outputs, worker):
        for seeds in (None, [3, 4, 5]):
            out = engine.generate(prompts, SamplingParams(max_new_tokens=4, logprobs=False), seeds)
            assert out.logprobs == [] and len(out.token_ids) == 3
        assert engine.sampling_params(SamplingParams(logprobs=False), 1).logprobs is None
        engine.shutdown()
    assert not llm.violations


def test_the_engine_turns_the_record_off_and_on_between_calls(vllm_module, tiny_model):
    """What the generation benchmark's ``--rounds`` does: both paths, alternately, on one engine."""
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model, sleep_level=0, logprobs_path="worker"))
    runner = FakeLLM.last.worker.model_runner
    prompts, params = [[1, 5], [1, 6]], SamplingParams(max_new_tokens=3)
    for on, path in ((False, "outputs"), (True, "worker"), (False, "outputs")):
        assert engine._rpc("xrlhf_record_logprobs", on) == [on]
        engine.logprobs_path = path
        assert (type(runner.sampler) is FakeSampler) is not on
        for seeds in (None, [1, 2]):
            out = engine.generate(prompts, params, seeds)
            assert [len(t) for t in out.token_ids] == [3, 3]
            want = [[-0.5, -1.0, -1.5] if seeds is None else [-t / 1e6 for t in ids] for ids in out.token_ids]
            assert out.logprobs == [pytest.approx(w, rel=1e-6) for w in want]  # the fake's logprobs, either path
    assert engine._rpc("xrlhf_record_logprobs") == [True]  # no argument: on, as the engine calls it
    engine.shutdown()
    assert not FakeLLM.last.violations


def test_concurrent_calls_and_a_restart_take_their_own_logprobs(vllm_module, tiny_model):
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model, sleep_level=0, logprobs_path="worker"))
    llm = FakeLLM.last
    asked = threading.Event()
    llm.llm_engine.on_step = lambda n: n == 3 and (asked.set(), wait_until(lambda: engine._loop._pause == "asked"))
    restarted = Caller(engine, [[1, 5], [1, 6]], SamplingParams(max_new_tokens=10), [7, 8])  # final-only: restarts
    assert asked.wait(TIMEOUT), restarted.error
    sync(engine, trained_weights(tiny_model), version=1)
    others = [Caller(engine, [[2, k]], SamplingParams(max_new_tokens=3 + k), [k]) for k in range(4)]
    for caller in [restarted, *others]:
        out = caller.result()
        assert all(lp == pytest.approx([-t / 1e6 for t in ids], rel=1e-6)  # the fake's logprob of each token
                   for ids, lp in zip(out.token_ids, out.logprobs))
        assert [len(t) for t in out.token_ids] == [len(lp) for lp in out.logprobs]
    record = llm.worker.model_runner.sampler._xrlhf_record
    assert not record.saved and not record.slot_of  # the restarted rows' first attempts were dropped
    assert len(llm.llm_engine.aborted) == 2
    engine.shutdown()
    assert not llm.violations, llm.violations
