"""Model shapes from a config.json alone: real public shapes and small ones of four more
architectures, parameter counts against hand-computed sums."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xrlhf.plan.shapes import model_shape
from xrlhf.utils.errors import UserError

SHAPES = Path(__file__).parents[2] / "configs" / "shapes"


def _write(tmp_path: Path, name: str, config: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def test_qwen2_5_7b_from_its_config_json():
    s = model_shape(str(SHAPES / "qwen2.5-7b"))
    # per layer: q 3584^2 + 3584 bias, k and v 3584 x 512 + 512, o 3584^2, MLP 3 x 3584 x 18944, 2 norms
    layer = (3584**2 + 3584) + 2 * (3584 * 512 + 512) + 3584**2 + 3 * 3584 * 18944 + 2 * 3584
    assert s.params == 28 * layer + 2 * 152064 * 3584 + 3584 == 7_615_616_512  # untied head
    assert (s.hidden, s.layers, s.kv_width, s.vocab, s.lm_head) == (3584, 28, 4 * 128, 152064, 152064 * 3584)
    assert s.kv_bytes_per_token(2) == 28 * 2 * 512 * 2  # 56 KiB per token in bf16


def test_llama_3_70b_from_its_config_json():
    s = model_shape(str(SHAPES / "llama-3-70b"))
    layer = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert s.params == 80 * layer + 2 * 128256 * 8192 + 8192 == 70_553_706_496
    assert (s.kv_width, s.intermediate) == (8 * 128, 28672)
    assert s.head_params("value") == s.params - 128256 * 8192 + 8192 + 1  # the LM head replaced by a 1-wide one


def test_w_model_shape_is_the_0_5b_preset():
    from xrlhf.models.tiny import preset_params

    assert model_shape(str(SHAPES / "model-0.5b")).params == 492_094_464 == preset_params("0.5b")


def test_gpt2_mistral_gemma_shapes(tmp_path):
    gpt2 = model_shape(_write(tmp_path, "gpt2", {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                 "vocab_size": 100, "n_positions": 32}))
    layer = 2 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + 2 * 64 + (64 * 256 + 256) + (256 * 64 + 64)
    assert gpt2.params == 100 * 64 + 32 * 64 + 2 * layer + 2 * 64
    assert (gpt2.intermediate, gpt2.kv_width, gpt2.lm_head) == (256, 64, 0)  # n_inner unset: 4 x; tied head
    mistral = model_shape(_write(tmp_path, "mistral", {
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}))
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert mistral.params == 2 * layer + 2 * 100 * 64 + 64 and mistral.kv_width == 32
    gemma = model_shape(_write(tmp_path, "gemma", {
        "model_type": "gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 48, "vocab_size": 100}))
    layer = 64 * 96 + 2 * 64 * 48 + 96 * 64 + 3 * 64 * 128 + 2 * 64  # head_dim 48 != 64 / 2
    assert gemma.params == 2 * layer + 100 * 64 + 64 and gemma.kv_width == 48


def test_a_directory_without_config_json_is_one_line(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        model_shape(str(tmp_path))
