"""Packed micro-batches (one row, no padding, varlen attention) give the padded path's numbers:
logprobs, entropy, values, scores, and a train step's loss, metrics and gradients."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import build_gpt2
from xrlhf.algorithms.losses import DPOLoss, PolicyLoss, SFTLoss, ValueLoss
from xrlhf.data.batch import Batch, build_sequences
from xrlhf.engines.hf import attention
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFInferEngine, HFTrainEngine
from xrlhf.engines.hf.packing import pack_rows, pad_rows

IDS = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 0, 0]])
ATTN = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])  # P = 3, R = 3


def test_pack_rows_by_hand():
    p = pack_rows(IDS, ATTN, 3)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert p.cu_seqlens.tolist() == [0, 4, 8] and p.cu_seqlens.dtype == torch.int32 and p.max_len == 4
    # response tokens 7, 8 (row 0) and 12 (row 1) are predicted by packed tokens 1, 2 and 6
    assert p.keep.tolist() == [1, 2, 6] and p.targets.tolist() == [[7, 8, 12]]
    assert p.last.tolist() == [3, 7]
    assert p.to_rows(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[1, 2, 0], [3, 0, 0]]
    assert p.last_token(torch.arange(8.0).view(1, 8)).tolist() == [3.0, 7.0]
    assert p.inputs["attention_mask"] is None and p.inputs["max_length_q"] == 4


def test_pad_rows_trims_padding_columns_by_hand():
    p = pad_rows(IDS, ATTN, 3)
    assert p.input_ids.tolist() == [[0, 5, 6, 7, 8], [9, 10, 11, 12, 0]]  # the last column is padding in both rows
    assert p.position_ids.tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 3]]
    assert p.keep.tolist() == [2, 3] and p.targets.tolist() == [[7, 8], [12, 0]]
    assert p.to_rows(torch.ones(2, 2)).tolist() == [[1, 1, 0], [1, 1, 0]]


@pytest.mark.parametrize("groups", [1, 2])
def test_varlen_attention_is_causal_sdpa_per_sequence(groups):
    torch.manual_seed(0)
    q = torch.randn(1, 4, 9, 8)
    k, v = torch.randn(1, 4 // groups, 9, 8), torch.randn(1, 4 // groups, 9, 8)
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    out, _ = attention.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu,
                                        max_length_q=5)
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    for s, e in [(0, 3), (3, 4), (4, 9)]:
        want = F.scaled_dot_product_attention(q[:, :, s:e], kk[:, :, s:e], vv[:, :, s:e], is_causal=True, scale=0.3)
        torch.testing.assert_close(out[:, s:e], want.transpose(1, 2))
    # without sequence offsets (a padded batch) it is transformers' sdpa with the given mask
    plain, _ = attention.varlen_attention(torch.nn.Module(), q, kk, vv, None, scaling=0.3)
    want = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=0.3)
    torch.testing.assert_close(plain, want.transpose(1, 2))


def rl_batch(n=10, seed=0, vocab=90) -> Batch:
    """Rows of mixed lengths, with what the PPO / value losses read."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    batch = build_sequences(prompts, responses, pad_id=0)
    g = torch.Generator().manual_seed(seed)
    shape = batch["response_mask"].shape
    batch["old_logprobs"] = -3 - torch.rand(shape, generator=g)
    batch["ref_logprobs"] = -3 - torch.rand(shape, generator=g)
    batch["advantages"] = torch.randn(shape, generator=g)
    batch["old_values"] = torch.randn(shape, generator=g)
    batch["returns"] = torch.randn(shape, generator=g)
    return batch


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tiny_model, tmp_path_factory):
    return tiny_model if request.param == "llama" else build_gpt2(tmp_path_factory.mktemp("gpt2") / "m")


def infer(model_dir, head, **options):
    spec = EngineSpec(model_dir, head=head, temperature=0.8, options={"micro_batch_size": 4, **options})
    engine = HFInferEngine(spec)
    return engine, engine.infer(rl_batch())


@pytest.mark.parametrize("head,key", [("causal_lm", "logprobs"), ("value", "values"), ("score", "scores")])
@pytest.mark.parametrize("packing", ["auto", "masked"])
def test_packed_infer_equals_padded(model_dir, head, key, packing):
    padded_engine, padded = infer(model_dir, head, packing="off")
    engine, packed = infer(model_dir, head, packing=packing, max_tokens_per_micro_batch=40)
    assert not padded_engine.packed and engine.packed
    assert engine.hf.attention_path == ("varlen" if packing == "auto" else "masked")
    mask = rl_batch()["response_mask"] if key != "scores" else 1.0
    torch.testing.assert_close(packed[key] * mask, padded[key] * mask, atol=2e-5, rtol=1e-5)


def grads_of_step(engine, batch, loss):
    """One ``train_step``'s metrics and every parameter's gradient, taken before the optimizer."""
    grads = {}

    def capture():
        grads.update({n: g.clone() for n, g in engine.named_grads().items() if g is not None})
        engine.optimizer.zero_grad(set_to_none=True)
        if engine.masters is not None:
            engine.masters.zero_grad()
        return {}

    engine.optimizer_step = capture
    return engine.train_step(batch, loss), grads


LOSSES = {
    "ppo": ("causal_lm", lambda: PolicyLoss(clip_eps=0.2, entropy_coef=0.01, kl_coef=0.05, kl_estimator="k3")),
    "ppo_metric_entropy": ("causal_lm", lambda: PolicyLoss(kl_coef=0.05, log_entropy=True)),
    "sft": ("causal_lm", SFTLoss),
    "critic": ("value", ValueLoss),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_packed_train_step_equals_padded(model_dir, name):
    head, loss = LOSSES[name]
    batch = rl_batch(12, seed=1)

    def step(**options):
        engine = HFTrainEngine(EngineSpec(model_dir, head=head, temperature=0.8, seed=0,
                                          options={"micro_batch_size": 5, "lr": 1e-3, **options}))
        return grads_of_step(engine, batch, loss())

    want, want_grads = step(packing="off", logprob_chunk_tokens=0)  # the path before packing and chunking
    got, grads = step(max_tokens_per_micro_batch=30)
    assert got.pop("packed") == 1.0 and want.pop("packed") == 0.0
    assert got.pop("micro_batches") > want.pop("micro_batches")  # 30 tokens: more, smaller ones
    assert got.keys() == want.keys()
    if name.startswith("ppo"):
        assert "policy/entropy" in got and "policy/kl_loss" in got
    tokens = int(batch["response_mask"].sum())
    for k in want:
        if k.endswith("_frac"):  # a fraction of `tokens` indicators: a value within rounding of a threshold may
            assert abs(got[k] - want[k]) <= 2 / tokens + 1e-6, k  # flip between paths (a CPU's kernels decide)
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    assert grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(grads[n], want_grads[n], atol=1e-6, rtol=1e-4, msg=n)


def test_pairs_stay_whole_under_a_token_budget(tiny_model):
    batch = rl_batch(8, seed=2)
    batch["ref_logps"] = -torch.rand(8) * 10
    engine = HFTrainEngine(EngineSpec(tiny_model, options={"micro_batch_size": 4, "max_tokens_per_micro_batch": 12}))
    parts = engine.micro_batches(batch, group=2)
    assert all(len(rows) % 2 == 0 and (rows[0::2] % 2 == 0).all() for rows, _ in parts)
    metrics = engine.train_step(batch, DPOLoss())
    assert metrics["micro_batches"] >= 3


def test_a_model_whose_attention_crosses_sequences_falls_back_to_padded(tiny_model, monkeypatch):
    def crossing(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)  # ignores cu_seq_lens
        return out.transpose(1, 2).contiguous(), None

    monkeypatch.setattr(attention, "varlen_attention", crossing)
    engine = HFInferEngine(EngineSpec(tiny_model))
    assert engine.hf.attention_path == "padded" and not engine.packed
    assert engine.hf.module.config._attn_implementation == "sdpa"  # put back
    with pytest.raises(ValueError, match="attention crosses packed sequences"):
        HFInferEngine(EngineSpec(tiny_model, options={"packing": "varlen"}))


def test_yaml_off_is_packing_off():
    import yaml

    from xrlhf.engines.hf import HFTrainOptions

    assert HFTrainOptions.model_validate(yaml.safe_load("packing: off")).packing == "off"
    assert HFTrainOptions.model_validate({"packing": True}).packing == "auto"
    with pytest.raises(ValueError, match="packing"):
        HFTrainOptions.model_validate({"packing": "sometimes"})


def test_the_engine_says_which_path_it_took(tiny_model):
    line = HFInferEngine(EngineSpec(tiny_model)).hf.prepare()
    assert "varlen micro-batches (attention xrlhf_varlen)" in line and "chunks of 1024 tokens" in line
    off = HFInferEngine(EngineSpec(tiny_model, options={"packing": "off", "logprob_chunk_tokens": 0}))
    assert off.hf.attention_path == "padded" and off.hf.logprob_chunk == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_a_forward_ran_is_recorded_from_its_tensors(tiny_model, monkeypatch, dtype):
    """``attention.TAKEN`` says what the forwards ran (the probe's forwards left out), once per
    kernel and dtype; here, on the CPU, the SDPA over the sequences side by side."""
    monkeypatch.setattr(attention, "TAKEN", {})
    monkeypatch.setattr(attention, "_LAST", [None])
    monkeypatch.setattr(attention, "_REPORTED", set())
    engine = HFInferEngine(EngineSpec(tiny_model, options={"dtype": dtype, "max_tokens_per_micro_batch": 40}))
    assert attention.TAKEN == {}  # the probe ran packed and padded forwards, and recorded neither
    engine.infer(rl_batch())
    name = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    assert list(attention.TAKEN) == [f"SDPA over the sequences side by side ({name} on cpu: not a GPU)"]
    assert attention.unreported() == [] and attention._REPORTED == set(attention.TAKEN)  # logged by the forward
    off = HFInferEngine(EngineSpec(tiny_model, options={"dtype": dtype, "packing": "off"}))
    off.infer(rl_batch())
    assert f"transformers sdpa on padded rows ({name} on cpu)" not in attention.TAKEN  # packing off: plain sdpa


def test_why_the_flash_kernel_is_not_taken():
    cpu = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    assert attention._no_flash(cpu, 0.0) == ": not a GPU"
    if torch.cuda.is_available():
        assert attention._no_flash(cpu.float().cuda(), 0.0) == ": flash takes bf16 or fp16 q/k/v"
        assert attention._no_flash(cpu.cuda(), 0.1) == ": attention dropout"


@pytest.mark.parametrize("style", ["2.10", "later"])
def test_torch_varlen_wrapper_follows_the_signature(monkeypatch, style):
    """torch 2.10's varlen_attn takes ``is_causal`` and no scale or GQA; later ones take
    ``window_size=(-1, 0)``, ``scale`` and ``enable_gqa``. The GPU runs the real one."""
    import torch.nn.attention.varlen as varlen

    seen = {}

    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        seen.update(is_causal=is_causal, heads=key.shape[1])
        return query

    def new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
            enable_gqa=False):
        seen.update(window_size=window_size, scale=scale, enable_gqa=enable_gqa, heads=key.shape[1])
        return query

    monkeypatch.setattr(varlen, "varlen_attn", old if style == "2.10" else new)
    monkeypatch.setattr(attention, "_VARLEN", {})
    q, kv = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    call = attention._torch_varlen(8, 8 ** -0.5)
    call(q, kv, kv, cu, 3, 8 ** -0.5, 2)
    if style == "2.10":
        assert seen == {"is_causal": True, "heads": 4}  # GQA by repeating the key/value heads
        assert attention._torch_varlen(8, 0.5) is None  # a scale it cannot take: not used
    else:
        assert seen == {"window_size": (-1, 0), "scale": 8 ** -0.5, "enable_gqa": True, "heads": 2}


def test_the_varlen_kernel_is_called_from_a_compiled_layer_without_a_graph_break(monkeypatch):
    """``compile: true`` on a GPU: the layer's call to torch's kernel (a custom op there) traces
    whole once ``install_varlen`` has resolved it, without dynamo's warning about caches."""
    import warnings
    import torch.nn.attention.varlen as varlen

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False):
        return query * scale

    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    monkeypatch.setattr(attention, "_VARLEN", {})
    attention._torch_varlen(8, 8 ** -0.5)  # what install_varlen resolves for a model of head dim 8

    @torch.compile(fullgraph=True, dynamic=True, backend="eager")
    def layer(q, k, v, cu, max_len):
        return attention._torch_varlen(8, 8 ** -0.5)(q, k, v, cu, max_len, 8 ** -0.5, 2)

    q, kv = torch.ones(5, 4, 8), torch.zeros(5, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = layer(q, kv, kv, torch.tensor([0, 2, 5], dtype=torch.int32), 3)
    torch.testing.assert_close(out, q * 8 ** -0.5)
