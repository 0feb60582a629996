"""``SamplingParams.logprobs=False``: a generate engine returns the same tokens and no logprobs
(``GenerationOutput.logprobs == []``, the contract of engines/base.py). The Transformers engine
here; the vLLM engine against the fake vLLM in test_vllm_record.py, on a GPU in
tests/gpu/test_vllm_speed_options.py."""

from __future__ import annotations

import pytest

from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.engines.hf import HFGenerateEngine

PROMPTS = ["12+7=", "3?9=", "sort 3 1 2:", "parity 1011:"]


@pytest.fixture(scope="module")
def prompts(tiny_model):
    tok = load_tokenizer(tiny_model)
    return [encode_prompt(tok, p) for p in PROMPTS]


@pytest.mark.parametrize("keyed", [False, True])
def test_hf_generate_without_logprobs_returns_the_same_tokens_and_none(tiny_model, prompts, keyed):
    seeds = [11, 12, 13, 14] if keyed else None  # unkeyed: an engine's stream moves on with each call, so two engines
    with_lp = HFGenerateEngine(EngineSpec(tiny_model, seed=3)).generate(prompts, SamplingParams(max_new_tokens=6), seeds)
    without = HFGenerateEngine(EngineSpec(tiny_model, seed=3)).generate(
        prompts, SamplingParams(max_new_tokens=6, logprobs=False), seeds)
    assert without.token_ids == with_lp.token_ids and without.versions == with_lp.versions
    assert without.logprobs == [] and [len(lp) for lp in with_lp.logprobs] == [len(t) for t in with_lp.token_ids]


def test_sampling_params_ask_for_logprobs_by_default():
    assert SamplingParams().logprobs is True
