"""Token budgets sized for the device (``engines.budget``): the arithmetic on W's model, and how an
engine uses a derived budget where its options set none. On the CPU nothing is derived, so the
micro-batches are what they always were; the GPU path is exercised here with the free memory
given by hand."""

from __future__ import annotations

import pytest
import torch

from tests.engines.test_packing import rl_batch
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.engines import budget
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFInferEngine, HFTrainEngine

GIB = 2 ** 30


def w_shape() -> budget.Shape:
    """The 0.5b preset (workload W's model), from its config built on the meta device."""
    from transformers import LlamaConfig

    return budget.Shape.of(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16))


def test_w_on_an_80_gib_gpu_trains_in_a_handful_of_micro_batches():
    shape = w_shape()
    per_token = budget.train_bytes_per_token(shape, 2, checkpointing=False, full_logits=False)
    # 24 layers x (9 x 1024 + 2 x 1024 + 4 x 4864) bf16 values, + 4 x 1024: 1.41 MiB per token
    assert per_token == (24 * (9 * 1024 + 2 * 1024 + 4 * 4864) + 4 * 1024) * 2
    b = budget.derive(60 * GIB, 0, budget.head_bytes(shape, 1024, True), per_token, 1.0, infer=False)
    w_tokens = 512 * (28 + 256)  # W's 512 sequences at most: prompts of 16-40 tokens, 256 new tokens
    assert 20_000 < b.tokens < 35_000 and 4 <= -(-w_tokens // b.tokens) <= 8
    assert "27,131 tokens" in b.describe("W train") and "60.0 GiB free" in b.describe("W train")
    # the optimizer states still to come, a co-located trainer's share, checkpointing
    assert budget.derive(60 * GIB, 8 * GIB, 0, per_token, 1.0, False).tokens < b.tokens
    half = budget.derive(60 * GIB, 0, 0, per_token, 0.5, False).tokens
    assert half == pytest.approx(budget.derive(60 * GIB, 0, 0, per_token, 1.0, False).tokens / 2, rel=0.05)
    assert budget.train_bytes_per_token(shape, 2, checkpointing=True, full_logits=False) < per_token / 10
    # the full head keeps 5 fp32 values per vocabulary word and token
    assert budget.train_bytes_per_token(shape, 2, False, True) == per_token + 5 * 32000 * 4


def test_infer_budgets_are_capped_and_every_budget_has_a_floor():
    shape = w_shape()
    per_token = budget.infer_bytes_per_token(shape, 2, full_logits=False)
    b = budget.derive(60 * GIB, 0, 0, per_token, 1.0, infer=True)
    assert b.tokens == budget.INFER_CAP and b.capped and "capped at 65536" in b.describe("infer")
    assert budget.derive(GIB // 2, 0, 0, per_token, 1.0, infer=True).tokens == budget.MIN_TOKENS


def test_the_shape_of_gpt2_and_grouped_query_configs():
    from transformers import GPT2Config, LlamaConfig

    gpt2 = budget.Shape.of(GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=100))
    assert gpt2 == budget.Shape(hidden=64, layers=3, intermediate=256, kv_width=64, vocab=100)
    gqa = budget.Shape.of(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                      intermediate_size=96, num_hidden_layers=2, vocab_size=10))
    assert gqa.kv_width == 16 and gqa.intermediate == 96


def test_the_automatic_logprob_chunk_holds_about_a_gib_of_fp32_logits_on_a_gpu():
    # 2^30 / (4 x 32,000) = 8,388 tokens: 8,192; 152k (Qwen) 1,766: 1,024; 128k (Llama 3) 2,093: 2,048
    assert [budget.logprob_chunk(v, "cuda") for v in (32_000, 151_936, 128_256, 50_257)] == [8192, 1024, 2048, 4096]
    assert budget.logprob_chunk(100, "cuda") == 8192 and budget.logprob_chunk(10**7, "cuda") == 1024  # clamped
    # on a CPU, and where the config names no vocabulary, the chunk of before
    assert budget.logprob_chunk(32_000, "cpu") == 1024 and budget.logprob_chunk(0, "cuda") == 1024


def test_an_engine_takes_the_chunk_set_or_the_automatic_one(tiny_model):
    from xrlhf.engines.hf.model import HFModelOptions

    assert HFModelOptions().chunk_tokens("cuda:0", 32_000) == 8192
    assert HFModelOptions().chunk_tokens("cpu", 32_000) == 1024
    assert HFModelOptions(logprob_chunk_tokens=0).chunk_tokens("cuda", 32_000) == 0  # full logits
    assert HFModelOptions(logprob_chunk_tokens=512).chunk_tokens("cuda", 32_000) == 512
    # the CPU engine's chunk, as before the automatic one (its numbers unchanged)
    assert HFInferEngine(EngineSpec(tiny_model, options={"micro_batch_size": 4})).hf.logprob_chunk == 1024


def test_on_the_cpu_nothing_is_derived(tiny_model):
    train = HFTrainEngine(EngineSpec(tiny_model, options={"micro_batch_size": 4}))
    infer = HFInferEngine(EngineSpec(tiny_model, options={"micro_batch_size": 4}))
    for e in (train, infer):
        assert e.derived_budget(False) is None and e.derived_budget(True) is None
        assert e.micro_batch_limits(False) == (4, None)
    assert [len(mb) for _, mb in train.micro_batches(rl_batch(10))] == [4, 4, 2]


def derive_as_on_a_gpu(engine, monkeypatch, free: int, infer: bool) -> list[int]:
    """``engine.derived_budget(infer)`` as on a GPU with ``free`` bytes free (derived once and
    kept: the forwards then run on the CPU as before); returns the pending bytes it counted."""
    seen = []
    real = budget.derive

    def derive(free_bytes, pending, fixed, per_token, share, infer):
        seen.append(pending)
        return real(free_bytes, pending, fixed, per_token, share, infer)

    with monkeypatch.context() as m:
        m.setattr(engine.hf, "device", torch.device("cuda"))
        m.setattr(budget, "free_bytes", lambda device: free)
        m.setattr(budget, "derive", derive)
        engine.derived_budget(infer)
    return seen


def test_a_derived_budget_fills_micro_batches_by_tokens_with_rows_uncapped(tiny_model, monkeypatch):
    e = HFTrainEngine(EngineSpec(tiny_model, options={"micro_batch_size": 2, "lr": 1e-3}))
    pending = derive_as_on_a_gpu(e, monkeypatch, budget.RESERVE_BYTES + 3 * 2**20, infer=False)
    per_token = budget.train_bytes_per_token(budget.Shape.of(e.hf.module.config), 4, False, False)
    assert e.micro_batch_limits(False) == (None, budget.MIN_TOKENS)  # ~3 MiB: the floor
    # counting AdamW's two fp32 states and the gradients of every weight (none exist before the first step)
    n = sum(p.numel() for p in e.params)
    assert pending == [2 * 4 * n + 4 * n] and per_token > 0
    batch = rl_batch(40)
    parts = e.micro_batches(batch)
    assert len(parts) == 1 and len(parts[0][1]) == 40  # 40 rows, ~400 tokens: one micro-batch, not 20 of 2
    metrics = e.train_step(batch, PolicyLoss(kl_coef=0.05))
    assert metrics["micro_batches"] == 1.0
    # an explicit budget wins, and so does an infer engine's own
    e.options.max_tokens_per_micro_batch = 100
    assert e.micro_batch_limits(False) == (2, 100)


def test_the_infer_budget_is_derived_apart_and_capped_rows_follow_infer_micro_batch_size(tiny_model, monkeypatch):
    e = HFTrainEngine(EngineSpec(tiny_model, options={"micro_batch_size": 2, "lr": 1e-3, "infer_micro_batch_size": 8}))
    pending = derive_as_on_a_gpu(e, monkeypatch, 80 * GIB, infer=True)
    assert e.micro_batch_limits(True) == (8, budget.INFER_CAP)
    assert pending == [0]  # a forward without gradients frees what it took: nothing to hold back
    ref = HFInferEngine(EngineSpec(tiny_model, options={"micro_batch_size": 2}))
    derive_as_on_a_gpu(ref, monkeypatch, 80 * GIB, infer=True)
    assert ref.micro_batch_limits(True) == (None, budget.INFER_CAP)
    assert len(ref.micro_batches(rl_batch(40), infer=True)) == 1
