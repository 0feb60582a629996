"""The memory model's pure functions against hand-computed numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from xrlhf.plan.memory import (
    GIB,
    VLLM_GRAPHS_FLOOR,
    VLLM_GRAPHS_W,
    Generator,
    Trainer,
    train_bytes_per_token,
    trainer_state,
    vllm_asleep,
    vllm_graphs,
    vllm_parts,
)
from xrlhf.plan.shapes import ModelShape

# 1,000 parameters, 2 layers x 8 wide, MLP 16, K/V 4 wide, vocab 10
S = ModelShape("toy", 1000, hidden=8, layers=2, intermediate=16, kv_width=4, vocab=10)


def test_bytes_per_parameter_by_precision():
    assert trainer_state(S, Trainer(precision="mixed")) == {"weights": 2000, "masters": 4000, "gradients": 4000,
                                                            "optimizer": 8000}  # 18 bytes a parameter
    assert trainer_state(S, Trainer(precision="bf16")) == {"weights": 2000, "gradients": 2000, "optimizer": 4000}
    assert trainer_state(S, Trainer(precision="fp32")) == {"weights": 4000, "gradients": 4000, "optimizer": 8000}
    assert "optimizer" not in trainer_state(S, Trainer(precision="mixed"), stepped=False)
    # LoRA: the frozen base in bf16, 100 fp32 adapter parameters with their gradients and AdamW states
    assert trainer_state(S, Trainer(precision="mixed", trainable=100)) == {
        "weights": 2000, "adapters": 400, "gradients": 400, "optimizer": 800}


def test_zero_stages_divide_by_the_ranks():
    def ds(**kw):
        return trainer_state(S, Trainer(engine="deepspeed", precision="mixed", ranks=4, **kw))

    assert ds(zero_stage=0) == {"weights": 2000, "masters": 4000, "gradients": 2000, "optimizer": 8000}
    assert ds(zero_stage=1) == {"weights": 2000, "masters": 1000, "gradients": 2000, "optimizer": 2000}
    # ZeRO-2: bf16 gradients partitioned, plus a reduce bucket (here the whole model: 1,000 < 5e8)
    assert ds(zero_stage=2) == {"weights": 2000, "masters": 1000, "gradients": 500, "optimizer": 2000,
                                "zero buffers": 2000}
    # ZeRO-3: weights partitioned too; the bucket and the live gathered weights
    assert ds(zero_stage=3) == {"weights": 500, "masters": 1000, "gradients": 500, "optimizer": 2000,
                                "zero buffers": 4000}
    assert ds(zero_stage=3, offload_optimizer=True, offload_params=True) == {"zero buffers": 4000}


def test_activations_per_token_with_and_without_checkpointing():
    # a layer keeps 9 H + 2 Hkv + 4 I = 72 + 8 + 64 = 144 values; + 4 H for embeddings and the head's input
    assert train_bytes_per_token(S, Trainer(precision="mixed")) == (2 * 144 + 32) * 2
    # checkpointing: each layer's input (H) and one layer recomputed
    assert train_bytes_per_token(S, Trainer(precision="mixed", checkpointing=True)) == (2 * 8 + 144 + 32) * 2
    # the full logits head: 5 fp32 values per vocabulary entry
    assert train_bytes_per_token(S, Trainer(precision="fp32", chunk=0)) == (2 * 144 + 32) * 4 + 5 * 10 * 4


def test_vllm_kv_cache_sized_or_filling_its_share():
    g = Generator(kv_tokens=100, max_num_seqs=2, batched_tokens=10)
    parts = vllm_parts(S, g, gpu_bytes=1 << 20)
    # profile: 10 tokens x (6 H + 2 Hkv + 4 I = 120) bf16 values, sampler 2 x 2 rows x 10 x fp32
    graphs = vllm_graphs(S, g)
    assert parts == {"weights": 2000, "activations": 10 * 240 + 160, "graphs": graphs,
                     "kv cache": 2 * 2 * 4 * 2 * (100 + 16 * 2)}  # a block per sequence more
    share = vllm_parts(S, Generator(gpu_memory_utilization=0.5, max_num_seqs=2, batched_tokens=10), 100_000)
    assert share["kv cache"] == 50_000 - 2000 - 2560
    assert vllm_asleep(parts, 2) == {"activations": 2560, "graphs": graphs}
    assert vllm_asleep(parts, 0) == parts
    assert GIB == 2**30


def test_vllm_graphs_between_the_two_measured_shapes():
    """0.09 GiB for a model of next to no activations, 0.20 GiB for W's 24 x 1,024 (both measured,
    torch.compile off), 0.39 with vLLM's torch.compile (measured 0.39); none when eager."""
    from xrlhf.plan.shapes import model_shape

    w = model_shape(str(Path(__file__).parents[2] / "configs" / "shapes" / "model-0.5b"))
    assert vllm_graphs(w, Generator()) == VLLM_GRAPHS_W
    assert vllm_graphs(w, Generator(torch_compile=True)) / GIB == pytest.approx(0.39, rel=0.05)
    assert vllm_graphs(w, Generator(enforce_eager=True)) == 0
    assert VLLM_GRAPHS_FLOOR <= vllm_graphs(S, Generator()) < VLLM_GRAPHS_FLOOR * 1.01
