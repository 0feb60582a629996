"""Token budgets sized for the device: how many tokens a micro-batch may hold where the user set
no ``max_tokens_per_micro_batch`` (train) / ``infer_max_tokens_per_micro_batch`` and the engine
runs on a GPU.

Why: a small model's train step on a GPU is bound by the host (each micro-batch is thousands of
kernel launches and Python calls), so the fewer micro-batches the faster, as long as their
activations fit. A budget set by hand fits one model, one GPU and one layout; this one is read
from the free memory when the engine first needs it (after the model and the other engines of
the GPU are built, before the optimizer states exist: those are counted as still to come) and
from the model's shape (activation bytes per token), with margins:

* **train**: per token and decoder layer a backward keeps about ``9 H + 2 Hkv + 4 I`` values of
  the compute dtype (two RMSNorms' fp32 input copies and bf16 outputs, q/k/v and the attention
  output, the MLP's gate, up, activation and product; ``H`` hidden, ``Hkv`` key/value width,
  ``I`` the MLP's width); with gradient checkpointing only each layer's input (``H``) is kept and
  one layer is recomputed at a time. The chunked logprob head costs one chunk's fp32 logits
  (three copies in its backward) whatever the tokens; the full head ``5 V`` fp32 values per token.
  With compiled layers (``compiled``: inductor fuses the norms and the MLP's activation and
  recomputes the cheap parts in the backward) ``6 H + 2 Hkv + 3 I``, which an engine whose layers
  compile derives its budget with.
* **infer** (no gradients): one layer's working set at a time, its MLP's at the peak: eager, the
  residual stream and the norm's output (``2 H``) beside the activation, the up projection and
  their product (``3 I``); compiled, ``3 H + 2 I`` (inductor writes the product over the
  activation's buffer); at least the attention's ``4 H + 2 Hkv``. Capped at
  ``INFER_CAP`` tokens: more tokens per forward save nothing that matters, and the cap bounds
  what engines inferring side by side on one GPU (the policy's old logprobs, the reference, a
  critic) take at once.

The planned share of the free memory is ``FRACTION`` times the engine's ``memory_share``
(``EngineSpec``: 1 unless the coordinator says that handles sharing the GPU train at the same
time), and activations are counted ``OVERHEAD`` times (the allocator's rounding and
fragmentation, a backward's transient gradients). A budget never goes below ``MIN_TOKENS``.
The formulas against measured memory: docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FRACTION = 0.8
"""Of the free memory (times the engine's share), what activations may plan for."""
OVERHEAD = 1.25
"""Activations planned at this many times their estimate."""
RESERVE_BYTES = 1 << 30
"""Left free for what the estimate leaves out (cuBLAS and NCCL workspaces, kernels loaded late)."""
INFER_CAP = 65536
"""The most tokens of one forward without gradients."""
MIN_TOKENS = 1024


@dataclass(frozen=True)
class Shape:
    """What the activation estimate reads of a model's config: widths and depth."""

    hidden: int
    layers: int
    intermediate: int
    kv_width: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        """The shape of a transformers config (Llama-style names, GPT-2's as a fallback)."""
        hidden = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd"))
        layers = int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer"))
        intermediate = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                           or 4 * hidden)
        heads = int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head"))
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(hidden, layers, intermediate, kv_heads * head_dim, int(getattr(config, "vocab_size", 0) or 0))


def train_bytes_per_token(shape: Shape, dtype_bytes: int, checkpointing: bool, full_logits: bool,
                          compiled: bool = False) -> int:
    """Bytes a forward with gradients keeps per token until its backward (see the module);
    ``compiled``: the decoder layers compiled (``HFModelOptions.compile``)."""
    if compiled and not checkpointing:
        layer = 6 * shape.hidden + 2 * shape.kv_width + 3 * shape.intermediate
    else:
        layer = 9 * shape.hidden + 2 * shape.kv_width + 4 * shape.intermediate
    kept = shape.layers * shape.hidden + layer if checkpointing else shape.layers * layer
    head = 5 * shape.vocab * 4 if full_logits else 0
    return (kept + 4 * shape.hidden) * dtype_bytes + head  # + embeddings, final norm and head input


def infer_bytes_per_token(shape: Shape, dtype_bytes: int, full_logits: bool, compiled: bool = False) -> int:
    """Bytes a forward without gradients holds per token at its peak (see the module);
    ``compiled``: the decoder layers compiled."""
    h = shape.hidden
    mlp = 3 * h + 2 * shape.intermediate if compiled else 2 * h + 3 * shape.intermediate
    head = 2 * shape.vocab * 4 if full_logits else 0
    return max(4 * h + 2 * shape.kv_width, mlp) * dtype_bytes + head


CHUNK_LOGITS_BYTES = 1 << 30
"""On a GPU, a logprob chunk holds about this many bytes of fp32 logits (``logprob_chunk``)."""
CHUNK_TOKENS = (1024, 8192)
"""The least and the most tokens of an automatic logprob chunk."""


def logprob_chunk(vocab: int, device_type: str) -> int:
    """Tokens per chunk of the logprob head where the options set none (``HFModelOptions``).

    On a GPU, the most tokens (a power of two in ``CHUNK_TOKENS``) whose fp32 logits fit
    ``CHUNK_LOGITS_BYTES``: each chunk is a GEMM, a log-softmax and their backward, and small
    chunks leave the GPU waiting on their launches (docs/training.md): a vocabulary of 32,000
    gives 8,192 tokens, one of 152k 1,024. Elsewhere
    1,024 tokens: a CPU gains nothing from larger ones, and its numbers stay as they were.
    """
    lo, hi = CHUNK_TOKENS
    if device_type != "cuda" or vocab <= 0:
        return lo
    fits = CHUNK_LOGITS_BYTES // (4 * vocab)
    return max(lo, min(hi, 1 << max(fits.bit_length() - 1, 0)))


def head_bytes(shape: Shape, chunk: int, training: bool) -> int:
    """The chunked logprob head's working memory: one chunk's fp32 logits (x3 in a backward)."""
    return chunk * shape.vocab * 4 * (3 if training else 2)


@dataclass(frozen=True)
class Budget:
    """A derived budget and the numbers it came from (for the log line)."""

    tokens: int
    free_bytes: int
    pending_bytes: int
    bytes_per_token: int
    share: float
    capped: bool

    def describe(self, what: str) -> str:
        gib = 2 ** 30
        cap = f", capped at {INFER_CAP}" if self.capped else ""
        pending = f" less {self.pending_bytes / gib:.1f} GiB still to allocate" if self.pending_bytes else ""
        return (f"{what}: micro-batches of up to {self.tokens:,} tokens (derived: {self.free_bytes / gib:.1f} GiB "
                f"free{pending}, {FRACTION:g} x share {self.share:g} of it for activations of "
                f"{self.bytes_per_token / 2**20:.2f} MiB per token x {OVERHEAD:g}{cap}; rows not capped; a token budget in "
                f"the options chooses instead)")


def free_bytes(device: torch.device) -> int:
    """The device's free memory plus what this process's allocator holds unused (it reuses that)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def derive(free: int, pending: int, fixed: int, per_token: int, share: float, infer: bool) -> Budget:
    """The budget for ``free`` bytes of which ``pending`` are still to be allocated by the engine
    (optimizer states, gradients) and ``fixed`` are taken whatever the tokens (the logprob head)."""
    room = max(0.0, (free - pending - RESERVE_BYTES) * FRACTION * share - fixed)
    tokens = int(room / (per_token * OVERHEAD))
    capped = infer and tokens > INFER_CAP
    tokens = max(MIN_TOKENS, min(tokens, INFER_CAP) if infer else tokens)
    return Budget(tokens, free, pending, per_token, share, capped)
