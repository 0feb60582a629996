"""Dropout is off in training unless a train section asks for it (``dropout: true``): with it,
two forwards of the same weights differ, so the PPO ratio and the KL carry noise."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_gpt2
from xrlhf.data.batch import build_sequences
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFTrainEngine
from xrlhf.models.tiny import build_model


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def dropout_model(request, tmp_path_factory) -> str:
    """GPT-2 with its default-like dropout 0.1, and a rotary Llama with attention dropout 0.1."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        return build_gpt2(root / "m", dropout=0.1)
    from transformers import AutoConfig

    path = build_model(root / "m", seed=0)
    config = AutoConfig.from_pretrained(path)
    config.attention_dropout = 0.1
    config.save_pretrained(path)
    return str(path)


def two_forwards(model_dir: str, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    engine = HFTrainEngine(EngineSpec(model_dir, options={"micro_batch_size": 4, **options}))
    assert engine.model.training  # the train engine's mode, where dropout would act
    batch = build_sequences([[1, 20, 21, 22], [1, 23, 24]], [[30, 31, 32, 2], [33, 2]], 0)
    with torch.no_grad():
        return engine.forward(batch).logprobs, engine.forward(batch).logprobs


def test_dropout_is_off_by_default(dropout_model):
    a, b = two_forwards(dropout_model, {})
    assert torch.equal(a, b)


def test_dropout_true_keeps_the_checkpoints_dropout(dropout_model):
    a, b = two_forwards(dropout_model, {"dropout": True})
    assert not torch.equal(a, b)
