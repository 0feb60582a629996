"""The Transformers backend on CPU with a tiny model: real forward, sampling and training."""

from __future__ import annotations

import pytest
import torch

from xrlhf.algorithms.losses import SFTLoss
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams, build_engine, engine_names
from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine, HFTrainEngine

PROMPTS = ["12+7=", "3?9=", "sort 3 1 2:", "parity 1011:"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


def prompt_ids(tok):
    return [encode_prompt(tok, p) for p in PROMPTS]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_generate_logprobs_equal_recomputed(tiny_model, tok, temperature, top_p):
    gen = HFGenerateEngine(EngineSpec(tiny_model, seed=3))
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=6)
    out = gen.generate(prompt_ids(tok), params)
    assert len(out.token_ids) == len(PROMPTS)
    assert all(len(t) == len(lp) and 1 <= len(t) <= 6 for t, lp in zip(out.token_ids, out.logprobs))
    batch = build_sequences(prompt_ids(tok), out.token_ids, tok.pad_token_id, out.logprobs)
    infer = HFInferEngine(EngineSpec(tiny_model, temperature=temperature))
    recomputed = infer.infer(batch)["logprobs"]
    mask = batch["response_mask"]
    torch.testing.assert_close(recomputed * mask, batch["rollout_logprobs"], atol=1e-5, rtol=1e-5)


def test_greedy_is_deterministic_and_stops(tiny_model, tok):
    gen = HFGenerateEngine(EngineSpec(tiny_model))
    a = gen.generate(prompt_ids(tok), SamplingParams(temperature=0, max_new_tokens=5))
    b = gen.generate(prompt_ids(tok), SamplingParams(temperature=0, max_new_tokens=5))
    assert a.token_ids == b.token_ids
    stop = a.token_ids[0][0]  # make the first sampled token a stop token: responses end there
    c = gen.generate(prompt_ids(tok)[:1], SamplingParams(temperature=0, max_new_tokens=5, stop_token_ids=[stop]))
    assert c.token_ids[0] == [stop]
    d = gen.generate(prompt_ids(tok), SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    assert all(len(t) == 5 for t in d.token_ids)


def sft_batch(tok, n=8):
    prompts = [encode_prompt(tok, f"{i}+{i}=") for i in range(n)]
    targets = [tok.encode(str(2 * i), add_special_tokens=False) + [tok.eos_token_id] for i in range(n)]
    return build_sequences(prompts, targets, tok.pad_token_id)


def test_training_reduces_loss_and_micro_batches_do_not_matter(tiny_model, tok):
    batch = sft_batch(tok)
    big = HFTrainEngine(EngineSpec(tiny_model, options={"lr": 1e-2, "micro_batch_size": 8}, seed=0))
    small = HFTrainEngine(EngineSpec(tiny_model, options={"lr": 1e-2, "micro_batch_size": 3}, seed=0))
    m_big = big.train_step(batch, SFTLoss())
    m_small = small.train_step(batch, SFTLoss())
    assert m_big["loss"] == pytest.approx(m_small["loss"], rel=1e-5)
    # the gradient itself, before Adam (whose first step is blind to a gradient's scale)
    assert m_big["grad_norm"] == pytest.approx(m_small["grad_norm"], rel=1e-5)
    for (n1, a), (_, b) in zip(big.named_weights(), small.named_weights()):
        # Adam's first step is lr * g / (|g| + eps): where |g| is near eps, fp32 summation-order
        # noise (packed rows differ with the micro-batch size) moves it by up to ~2e-3 of the step
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5, msg=n1)
    losses = [big.train_step(batch, SFTLoss())["loss"] for _ in range(10)]
    assert losses[-1] < m_big["loss"] * 0.7


def test_save_pretrained_loads_in_transformers(tiny_model, tok, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = HFTrainEngine(EngineSpec(tiny_model, options={"lr": 1e-2}))
    engine.train_step(sft_batch(tok), SFTLoss())
    engine.save_pretrained(str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    AutoTokenizer.from_pretrained(tmp_path / "out")
    for name, t in engine.named_weights():
        torch.testing.assert_close(loaded.state_dict()[name], t)


def test_update_weights_changes_generation(tiny_model, tok):
    gen = HFGenerateEngine(EngineSpec(tiny_model))
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    before = gen.generate(prompt_ids(tok), params).token_ids
    trainer = HFTrainEngine(EngineSpec(tiny_model, options={"lr": 5e-2}))
    for _ in range(5):
        trainer.train_step(sft_batch(tok), SFTLoss())
    gen.update_weights(trainer.named_weights())
    after = gen.generate(prompt_ids(tok), params).token_ids
    assert before != after
    with pytest.raises(KeyError, match="not a parameter"):
        gen.update_weights([("nope.weight", torch.zeros(1))])


def test_value_and_score_heads(tiny_model, tok):
    batch = sft_batch(tok, 4)
    values = HFInferEngine(EngineSpec(tiny_model, head="value")).infer(batch)["values"]
    assert values.shape == batch["response_mask"].shape
    scores = HFInferEngine(EngineSpec(tiny_model, head="score")).infer(batch)["scores"]
    assert scores.shape == (4,)


def test_registry_names_and_import_paths(tiny_model):
    assert "hf" in engine_names("train") and "vllm" in engine_names("generate")
    with pytest.raises(KeyError, match="valid: .*hf"):
        build_engine("nope", EngineSpec(tiny_model), "train")
    engine = build_engine("xrlhf.engines.hf:HFInferEngine", EngineSpec(tiny_model), "infer")
    assert isinstance(engine, HFInferEngine)
    with pytest.raises(KeyError, match="not a TrainEngine"):
        build_engine("xrlhf.engines.hf:HFInferEngine", EngineSpec(tiny_model), "train")
