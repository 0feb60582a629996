"""The vLLM engine's speed and start-up options on a GPU (issue 25): generation without logprobs,
logprobs kept in vLLM's worker (``logprobs_path: worker``), a KV cache sized by
``kv_cache_tokens``, the engine core in process without torch.compile.

One engine serves the module (float32 small model, sleep level 2, per-request seeds, KV cache
sized for its batch); the worker path is switched on mid-module, as the benchmarks do. The
logprob contract is checked as tests/gpu/test_vllm_engine.py does: the Transformers engine
recomputes vLLM's tokens at the same temperature. Run: ``pytest -m gpu tests/gpu/test_vllm_speed_options.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.gpu.gpu_helpers import generate_options
from tests.gpu.test_vllm_engine import HF
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.envs import build_env
from xrlhf.weight_sync import build_transport, push_weights

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")

SAMPLED = SamplingParams(temperature=0.7, max_new_tokens=48)
OPTIONS = dict(gpu_memory_utilization=0.25, sleep_level=2, max_model_len=256, max_num_seqs=64, seeded_sampling=True,
               kv_cache_tokens="batch")


@pytest.fixture(scope="module")
def engine(small_model):
    from xrlhf.engines.vllm import VLLMGenerateEngine

    options = generate_options(**OPTIONS)
    engine = VLLMGenerateEngine(EngineSpec(small_model, device="cuda", seed=0, options={**options, "dtype": "float32"}))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(small_model):
    tok = load_tokenizer(small_model)
    env = build_env("reasoning", {"eval_size": 48}, 0)
    return [encode_prompt(tok, p.text) for p in env.eval_prompts()]


SEEDS = list(range(1000, 1048))


def contract_gap(model: str, prompts, out, temperature: float = 0.7) -> float:
    """Largest |vLLM's logprob - the Transformers engine's recomputation| over the sampled tokens."""
    from xrlhf.engines.hf import HFInferEngine

    batch = build_sequences(prompts, out.token_ids, load_tokenizer(model).pad_token_id, out.logprobs)
    infer = HFInferEngine(EngineSpec(model, device="cuda", options=HF, temperature=temperature))
    diff = (batch["rollout_logprobs"] - infer.infer(batch)["logprobs"].cpu())[batch["response_mask"].bool()]
    return float(diff.abs().max())


def test_the_kv_cache_is_sized_by_kv_cache_tokens(engine, small_model):
    from xrlhf.engines.vllm.options import kv_cache_bytes

    assert not type(engine).starts_alone_with(engine.options)
    cc = engine.llm.llm_engine.vllm_config.cache_config
    assert cc.kv_cache_memory_bytes == kv_cache_bytes(small_model, engine.options)
    if cc.num_gpu_blocks:  # the client's copy may not carry it
        assert cc.num_gpu_blocks * cc.block_size >= 64 * 256


def test_without_logprobs_the_same_tokens_come_back_and_no_logprobs(engine, prompts):
    with_lp = engine.generate(prompts, SAMPLED, SEEDS)
    without = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=48, logprobs=False), SEEDS)
    assert without.logprobs == [] and len(without.token_ids) == len(prompts)
    same = sum(a == b for a, b in zip(with_lp.token_ids, without.token_ids))
    assert same >= len(prompts) - 2, f"only {same} of {len(prompts)} rows equal"  # same seeds, same batch
    unkeyed = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=8, logprobs=False))
    assert unkeyed.logprobs == [] and all(unkeyed.token_ids)


def test_worker_logprobs_equal_vllms_own_and_keep_the_contract(engine, small_model, prompts):
    outputs = engine.generate(prompts, SAMPLED, SEEDS)
    engine._rpc("xrlhf_record_logprobs")
    engine.options.logprobs_path = "worker"
    worker = engine.generate(prompts, SAMPLED, SEEDS)
    assert [len(x) for x in worker.logprobs] == [len(t) for t in worker.token_ids]
    for a, b, ta, tb in zip(outputs.logprobs, worker.logprobs, outputs.token_ids, worker.token_ids):
        if ta == tb:  # the same kernel on the same processed logits
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert contract_gap(small_model, prompts, worker) < 2e-3
    unkeyed = engine.generate(prompts, SAMPLED)  # LLM.generate's path: the request ids are its counter
    assert contract_gap(small_model, prompts, unkeyed) < 2e-3


def test_worker_logprobs_after_a_sleep_and_a_sync(engine, small_model, prompts):
    from xrlhf.engines.hf import HFTrainEngine

    assert engine.options.logprobs_path == "worker"
    t = HFTrainEngine(EngineSpec(small_model, device="cuda", options={"lr": 1e-3, **HF}))
    engine.sleep()
    push_weights(build_transport("cpu"), t.named_weights(), engine.receive_weights)
    engine.end_sync(1)
    out = engine.generate(prompts, SAMPLED)
    assert contract_gap(small_model, prompts, out) < 2e-3 and all(v == [1] * len(v) for v in out.versions)


def test_worker_logprobs_across_a_recompute_mid_generation(engine, small_model, prompts):
    """A sync while keyed rows generate, ``on_update: recompute``: vLLM preempts every running
    request and resumes it (its KV recomputed), so each row's record comes in pieces from two
    slots. The weights synced are the same, so every logprob must still be the model's."""
    from xrlhf.engines.hf import HFTrainEngine

    t = HFTrainEngine(EngineSpec(small_model, device="cuda", options={"lr": 1e-3, **HF}))
    params = SamplingParams(temperature=0.7, max_new_tokens=150, ignore_eos=True, on_update="recompute",
                            in_flight=True)
    result: dict = {}
    caller = threading.Thread(target=lambda: result.update(out=engine.generate(prompts, params, SEEDS)), daemon=True)
    start = engine._loop.tokens_collected
    caller.start()
    deadline = time.monotonic() + 120
    while engine._loop.tokens_collected - start < 20 * len(prompts):  # well into the call
        assert time.monotonic() < deadline and caller.is_alive()
        time.sleep(0.005)
    push_weights(build_transport("cpu"), t.named_weights(), engine.receive_weights)
    engine.end_sync(2)
    caller.join(180)
    out = result["out"]
    assert all(len(t) == 150 for t in out.token_ids)
    assert any(len(set(v)) == 2 for v in out.versions)  # the sync did land mid-row
    assert contract_gap(small_model, prompts, out) < 2e-3


def test_an_in_process_engine_without_compile_generates_as_the_compiled_one(engine, small_model, prompts):
    """Last: the engine core in this process (no spawn), no torch.compile, decode steps as whole
    CUDA graphs; float32 greedy tokens equal the module engine's."""
    from xrlhf.engines.vllm import VLLMGenerateEngine

    options = generate_options(**{**OPTIONS, "sleep_level": 0, "multiprocessing": False, "torch_compile": False,
                                  "gpu_memory_utilization": 0.2})
    fast = VLLMGenerateEngine(EngineSpec(small_model, device="cuda", seed=0, options={**options, "dtype": "float32"}))
    try:
        assert fast.model_in_process  # InprocClient
        greedy = SamplingParams(temperature=0, max_new_tokens=24)
        a, b = fast.generate(prompts, greedy), engine.generate(prompts, greedy)
        same = sum(x == y for x, y in zip(a.token_ids, b.token_ids))
        assert same >= len(prompts) - 1, f"{same} of {len(prompts)}"  # two kernels may part at a near-tie
        for x, y, tx, ty in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
            if tx == ty:
                torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=2e-3, rtol=0)
    finally:
        fast.shutdown()
