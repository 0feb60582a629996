"""Model shapes for the planner, read from a model directory's ``config.json`` alone.

Why from ``config.json`` only: a plan for a 7B or 70B run is made before anyone downloads (or
could even hold) the weights. Transformers' ``AutoConfig`` reads the file (any architecture it
knows: Llama, Qwen2, Mistral, Gemma, GPT-2 ...), and the parameter count is taken from the
model built on the meta device (no memory, exact for every architecture: tied embeddings once,
biases, extra norms). Nothing is ever fetched from a hub (``local_files_only``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from xrlhf.utils.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    """What the memory model reads of a causal LM: sizes and widths.

    Attributes:
        name: the model directory's name (for tables).
        params: parameters of the causal LM (tied weights once).
        hidden, layers, intermediate: the residual width, the decoder layers, the MLP's width.
        kv_width: ``num_key_value_heads x head_dim``: one layer's K (or V) per token.
        vocab: the vocabulary (the logits' width).
        lm_head: parameters of an untied output head (0 when tied to the embeddings).
        largest_layer: parameters of the largest block (a decoder layer or the embeddings):
            what ZeRO-3 gathers at least at once.
        heads: attention heads (a tensor-parallel size must divide them; 0: unknown).
    """

    name: str
    params: int
    hidden: int
    layers: int
    intermediate: int
    kv_width: int
    vocab: int
    lm_head: int = 0
    largest_layer: int = 0
    heads: int = 0

    def head_params(self, head: str) -> int:
        """Parameters of the model with ``head``: ``causal_lm``, or ``value`` / ``score`` (the
        LM head replaced by a one-wide linear layer)."""
        if head == "causal_lm":
            return self.params
        return self.params - self.lm_head + self.hidden + 1

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """One token's K and V in every layer (vLLM's KV cache, a generator's cache)."""
        return self.layers * 2 * self.kv_width * dtype_bytes


def config_shape(config, name: str, params: int, lm_head: int, largest_layer: int) -> ModelShape:
    """A ``ModelShape`` from a transformers config (Llama-style names, GPT-2's as a fallback)."""
    text = getattr(config, "text_config", None) or config
    hidden = int(getattr(text, "hidden_size", None) or text.n_embd)
    layers = int(getattr(text, "num_hidden_layers", None) or text.n_layer)
    intermediate = int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden)
    heads = int(getattr(text, "num_attention_heads", None) or text.n_head)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return ModelShape(name, params, hidden, layers, intermediate, kv_heads * head_dim,
                      int(getattr(text, "vocab_size", 0) or 0), lm_head, largest_layer, heads)


@lru_cache(maxsize=32)
def model_shape(model_dir: str) -> ModelShape:
    """The shape of the model at ``model_dir`` (its ``config.json``; no weights read).

    Raises:
        UserError: no ``config.json`` there, or one Transformers cannot read.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"policy.model: {model_dir} has no config.json (the planner reads the model's shape from it)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - Transformers raises many kinds: say which file
        raise UserError(f"policy.model: {path / 'config.json'}: {str(e).splitlines()[0]}") from None
    unique = {id(p): p.numel() for p in model.parameters()}
    params = sum(unique.values())
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    lm_head = 0 if out is None or out.weight is inp.weight else out.weight.numel()
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    layer = max((sum(p.numel() for p in b[0].parameters()) for b in blocks if len(b)), default=0)
    return config_shape(config, path.name, params, lm_head, max(layer, inp.weight.numel()))
