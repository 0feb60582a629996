"""Small models of real architectures other than Llama, built locally (issue 17, item 6).

The engines and the weight-sync transports must not depend on Llama's layout. These builders
write randomly initialised models with the char tokenizer (and its chat template) of
:mod:`xrlhf.models.tiny`:

* ``qwen2``: ``Qwen2ForCausalLM``: grouped-query attention (4 query heads, 2 key/value heads),
  biases on the q/k/v projections, **untied** input and output embeddings;
* ``gpt2``: ``GPT2LMHeadModel``: ``Conv1D`` layers (weights stored ``[in, out]``, the transpose of
  ``nn.Linear``), fused ``c_attn`` q/k/v, learned absolute positions, LayerNorm with biases.

``xrlhf make-tiny-model DIR --arch qwen2`` writes one; tests build them in a temporary directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from xrlhf.models.tiny import DTYPES, build_tokenizer, round_up

Arch = Literal["qwen2", "gpt2"]
ARCHS: tuple[str, ...] = ("qwen2", "gpt2")


def build_arch_model(out_dir: str | Path, arch: Arch, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                     max_positions: int = 256, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random ``arch`` model and the char tokenizer to ``out_dir``; a function of the
    arguments alone.

    Raises:
        ValueError: for an unknown ``arch`` or ``dtype``.
    """
    if arch not in ARCHS:
        raise ValueError(f"build_arch_model: arch={arch!r} is not one of {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"build_arch_model: dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    tok = build_tokenizer("char")
    tok.model_max_length = max_positions
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vocab = round_up(len(tok), 64)
    torch.manual_seed(seed)
    if arch == "qwen2":
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=max(1, heads // 2), max_position_embeddings=max_positions,
                             tie_word_embeddings=False, **ids)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():  # Qwen2 initialises the q/k/v biases to zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.02)
    else:
        config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                            n_positions=max_positions, tie_word_embeddings=True, **ids)
        model = GPT2LMHeadModel(config)
    model.generation_config = GenerationConfig(**ids)
    model.to(DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
