"""Packed micro-batches on one GPU in bf16: torch's varlen flash attention is chosen (the probe
passed, the kernel ran forward and backward) and gives the padded path's numbers within bf16
tolerance; the train step's loss and gradients agree too.

Run: ``pytest -m gpu tests/gpu/test_packing_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.engines import attention
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
    assert "torch varlen flash attention" in packed.hf.prepare()
    padded = HFInferEngine(EngineSpec(small_model, device="cuda", options={
        "dtype": "bfloat16", "micro_batch_size": 8, "packing": "off", "logprob_chunk_tokens": 0}))
    batch = _batch()
    mask = batch["response_mask"]
    a, b = packed.infer(batch)["logprobs"] * mask, padded.infer(batch)["logprobs"] * mask
    assert (a - b).abs().max() < 0.1  # bf16 through 4 layers: rounding, not crossed sequences


def test_train_step_matches_padded_in_bf16(small_model):
    def step(**options):
        engine = HFTrainEngine(EngineSpec(small_model, device="cuda", seed=0, options={
            "dtype": "bfloat16", "micro_batch_size": 8, "lr": 1e-5, **options}))
        grads = {}

        def capture():
            grads.update({n: p.grad.float().clone() for n, p in engine.model.named_parameters()})
            engine.optimizer.zero_grad(set_to_none=True)
            return {}

        engine.optimizer_step = capture
        return engine.train_step(_batch(), PolicyLoss(kl_coef=0.05, entropy_coef=0.01)), grads

    (m_new, g_new), (m_old, g_old) = step(max_tokens_per_micro_batch=200), step(packing="off", logprob_chunk_tokens=0)
    assert m_new["packed"] == 1.0 and abs(m_new["loss"] - m_old["loss"]) < 2e-2 * (1 + abs(m_old["loss"]))
    num = sum((g_new[n] - g_old[n]).norm() ** 2 for n in g_old) ** 0.5
    den = sum(g.norm() ** 2 for g in g_old.values()) ** 0.5
    assert num / den < 0.05
