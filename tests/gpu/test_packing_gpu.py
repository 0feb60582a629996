"""Packed micro-batches on one GPU in bf16: torch's varlen flash attention is chosen (the probe
passed, the kernel ran forward and backward) and gives the padded path's numbers within bf16
tolerance; the train step's loss and gradients agree too.

Run: ``pytest -m gpu tests/gpu/test_packing_gpu.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.engines.hf import attention
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFInferEngine, HFTrainEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _batch():
    from tests.engines.test_packing import rl_batch

    return rl_batch(24, seed=3)


def test_varlen_flash_is_chosen_and_matches_padded(small_model):
    spec = dict(device="cuda", options={"dtype": "bfloat16", "micro_batch_size": 8})
    packed = HFInferEngine(EngineSpec(small_model, **spec))
    assert packed.hf.attention_path == "varlen" and not attention._FLASH_FAILED
    attention.TAKEN.clear()
    padded = HFInferEngine(EngineSpec(small_model, device="cuda", options={
        "dtype": "bfloat16", "micro_batch_size": 8, "packing": "off", "logprob_chunk_tokens": 0}))
    batch = _batch()
    mask = batch["response_mask"]
    a = packed.infer(batch)["logprobs"] * mask
    assert list(attention.TAKEN) == ["torch varlen flash attention (bf16 on cuda)"]  # what the forward ran
    b = padded.infer(batch)["logprobs"] * mask
    assert (a - b).abs().max() < 0.1  # bf16 through 4 layers: rounding, not crossed sequences


def test_train_step_matches_padded_in_bf16(small_model):
    def step(**options):
        engine = HFTrainEngine(EngineSpec(small_model, device="cuda", seed=0, options={
            "dtype": "bfloat16", "micro_batch_size": 8, "lr": 1e-5, **options}))
        grads = {}

        def capture():  # bf16 on a GPU trains with fp32 masters by default: their fp32 gradients
            grads.update({n: g.float().clone() for n, g in engine.named_grads().items()})
            engine.optimizer.zero_grad(set_to_none=True)
            if engine.masters is not None:
                engine.masters.zero_grad()
            return {}

        engine.optimizer_step = capture
        return engine.train_step(_batch(), PolicyLoss(kl_coef=0.05, entropy_coef=0.01)), grads

    (m_new, g_new), (m_old, g_old) = step(max_tokens_per_micro_batch=200), step(packing="off", logprob_chunk_tokens=0)
    assert m_new["packed"] == 1.0 and abs(m_new["loss"] - m_old["loss"]) < 2e-2 * (1 + abs(m_old["loss"]))
    num = sum((g_new[n] - g_old[n]).norm() ** 2 for n in g_old) ** 0.5
    den = sum(g.norm() ** 2 for g in g_old.values()) ** 0.5
    assert num / den < 0.05


def test_the_default_mixed_precision_trains_with_flash_attention(small_model):
    """bf16 weights with fp32 masters (the GPU default): q/k reach the attention in bf16, and the
    forward and backward run torch's varlen flash kernel (recorded from the tensors)."""
    engine = HFTrainEngine(EngineSpec(small_model, device="cuda", seed=0, options={
        "dtype": "bfloat16", "micro_batch_size": 8, "lr": 1e-5}))
    assert engine.mixed_precision and engine.masters is not None
    attention.TAKEN.clear()
    metrics = engine.train_step(_batch(), PolicyLoss(kl_coef=0.05, entropy_coef=0.01))
    assert metrics["packed"] == 1.0 and metrics["skipped"] == 0.0
    assert list(attention.TAKEN) == ["torch varlen flash attention (bf16 on cuda)"]


def _syncs_of_a_step(engine, budget: int) -> tuple[Counter, float]:
    """Synchronizing CUDA calls of one ``train_step`` (torch's sync debug mode), counted by the
    calling line (file:line), and its micro-batches."""
    import warnings

    engine.options.max_tokens_per_micro_batch = budget
    loss = PolicyLoss(kl_coef=0.05, entropy_coef=0.01)
    engine.train_step(_batch(), loss)  # warm-up: the first call allocates
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            metrics = engine.train_step(_batch(), loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return Counter(f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)), metrics["micro_batches"]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_train_step_waits_for_the_device_as_often_with_more_micro_batches(small_model, compile):
    """Layouts are built on the host and metrics read once: the device's queue never drains
    between micro-batches, however many there are. The 24 rows (198 tokens) make one micro-batch
    under a budget of 2,000 tokens and four under 60: the rows cap (24) lets the budgets bind (at
    8 rows both gave 3 micro-batches, on an H100). A failure names the lines that waited more often.
    One H100, 2026-11-26: 7 waits for one micro-batch, 9 for four (transformers'
    ``find_packed_sequence_indices``, once per micro-batch; gone since the packed rows pass
    ``attention.no_mask()``); then, eager, 6 for one and 5 for four: the one-micro-batch step also
    waited once in ``torch.cuda`` (a one-off, not the layout's), hence "no more", not "equal"."""
    engine = HFTrainEngine(EngineSpec(small_model, device="cuda", seed=0, options={
        "dtype": "bfloat16", "micro_batch_size": 24, "lr": 1e-5, "compile": compile}))
    few_syncs, few = _syncs_of_a_step(engine, 2000)
    many_syncs, many = _syncs_of_a_step(engine, 60)
    assert (few, many) == (1, 4)
    assert not many_syncs - few_syncs, (many_syncs - few_syncs, few_syncs - many_syncs)  # no line waits more often


def test_compiled_layers_give_the_eager_step_on_the_gpu(small_model):
    from torch._dynamo.utils import counters

    def step(compile: bool):
        engine = HFTrainEngine(EngineSpec(small_model, device="cuda", seed=0, options={
            "dtype": "bfloat16", "micro_batch_size": 8, "lr": 1e-5, "max_tokens_per_micro_batch": 200,
            "compile": compile}))
        metrics = engine.train_step(_batch(), PolicyLoss(kl_coef=0.05, entropy_coef=0.01))
        return metrics, engine.infer(_batch())["logprobs"]

    (m_eager, lp_eager) = step(False)
    counters.clear()
    (m_comp, lp_comp) = step(True)
    assert not counters["graph_break"], dict(counters["graph_break"])  # torch's varlen flash traced whole
    assert m_comp["packed"] == 1.0 and abs(m_comp["loss"] - m_eager["loss"]) < 2e-2 * (1 + abs(m_eager["loss"]))
    mask = _batch()["response_mask"]
    assert ((lp_comp - lp_eager) * mask).abs().max() < 0.1  # bf16 rounding, fused differently
