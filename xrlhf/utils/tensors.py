"""Tensor helpers shared by the engine and algorithm layers (no Ray, no model code)."""

from typing import Callable

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension, in nats.

    Computed as ``logsumexp(x) - sum(p * x)`` on ``x = logits - max(logits)``: shifting
    first avoids the cancellation of two large numbers (1000.69 - 1000.0 in float32 keeps
    only ~4 digits). ``-inf`` logits (banned tokens) contribute 0.

    Args:
        logits: ``[..., V]``.
    Returns:
        ``[...]``.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(shifted, dim=-1)
    # zero the -inf logits BEFORE multiplying: 0 * -inf is nan, in the value and in the grad
    finite = torch.where(probs > 0, shifted, torch.zeros_like(shifted))
    return torch.logsumexp(shifted, dim=-1) - (probs * finite).sum(-1)


def chunked_token_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                           temperature: float = 1.0, chunk: int = 1024, need_entropy: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprob (and entropy) of ``softmax(head(hidden) / temperature)``, ``chunk``
    tokens at a time: ``chunked_head_columns`` for one target per token.

    Args:
        hidden: ``[N, H]`` the hidden states that predict each token.
        head: ``[c, H] -> [c, V]`` (the model's output layer, called as it is).
        targets: ``[N]`` token ids.
        temperature, chunk, need_entropy: as in ``chunked_head_columns``.

    Returns:
        ``(logprobs [N], entropy [N] or None)``, fp32.
    """
    out = chunked_head_columns(hidden, head, targets, temperature, chunk, need_entropy)
    return out[:, 0], (out[:, 1] if need_entropy else None)


def head_columns(z: torch.Tensor, targets: torch.Tensor, need_entropy: bool = False, topk: int = 0) -> torch.Tensor:
    """The columns of ``chunked_head_columns`` from fp32 logits already divided by the temperature.

    Args:
        z: ``[..., V]`` logits.
        targets: ``[..., m]`` token ids to gather.
    Returns:
        ``[..., m + e + 2 * topk]``: gathered logprobs, the entropy, the top-k logprobs and ids.
    """
    logp = torch.log_softmax(z, -1)
    parts = [torch.gather(logp, -1, targets)]
    if need_entropy:
        parts.append(entropy_from_logits(z).unsqueeze(-1))
    if topk:
        values, ids = torch.topk(logp, topk, dim=-1)
        parts += [values, ids.float()]
    return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


def chunked_head_columns(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                         temperature: float = 1.0, chunk: int = 1024, need_entropy: bool = False,
                         topk: int = 0, compiled: bool = False) -> torch.Tensor:
    """What the logprob head computes per token, ``chunk`` tokens at a time, so at most one
    chunk's ``[chunk, V]`` logits exist at once, as columns of one ``[N, C]`` fp32 tensor.

    Each chunk is the plain computation (``head`` in the model's dtype, then fp32: divide by
    the temperature, ``log_softmax``, gather; ``entropy_from_logits``; ``topk``). With autograd
    on, a chunk runs under non-reentrant activation checkpointing: the graph keeps only the
    chunk's ``hidden`` rows, and the backward recomputes its logits, one chunk at a time. That
    is the point: a forward over ``[B, T]`` tokens with a ``V``-word vocabulary otherwise keeps
    ``B * T * V`` fp32 values (logits, log-softmax, softmax) alive until the backward.

    Args:
        hidden: ``[N, H]`` the hidden states that predict each token.
        head: ``[c, H] -> [c, V]``.
        targets: ``[N]`` or ``[N, m]`` token ids whose logprobs are gathered (several per token:
            the sampled one and a teacher's top-k ids, for top-k distillation).
        temperature: logits are divided by it (> 0).
        chunk: tokens per chunk; 0: all at once without recomputation (the logits of every
            token are kept for the backward: the layout before chunking, for comparison).
        need_entropy: also the entropy of each token's distribution.
        topk: also the ``topk`` largest logprobs of each token's distribution and their ids (as
            floats: exact for ids below 2**24; no gradient flows through the ids).
        compiled: each chunk through ``torch.compile`` (``compiled_chunk_columns``): the engines
            whose layers compile (a GPU's) take it.

    Returns:
        ``[N, m + e + 2 * topk]``: the ``m`` gathered logprobs (``m = 1`` for ``[N]`` targets),
        the entropy (``e = 1`` with ``need_entropy``), the top-k logprobs, the top-k ids.
    """
    from torch.utils.checkpoint import checkpoint

    cols = targets.unsqueeze(-1) if targets.dim() == 1 else targets

    columns = compiled_chunk_columns() if compiled else chunk_columns

    def one(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return columns(h, t, head, temperature, need_entropy, topk)

    n = hidden.shape[0]
    if chunk <= 0 or n <= chunk and not torch.is_grad_enabled():
        return one(hidden, cols)
    recompute = torch.is_grad_enabled()
    parts = [checkpoint(one, hidden[s:s + chunk], cols[s:s + chunk], use_reentrant=False,
                        preserve_rng_state=False)  # nothing random to replay; saves a device sync per chunk
             if recompute else one(hidden[s:s + chunk], cols[s:s + chunk]) for s in range(0, n, chunk)]
    width = cols.shape[1] + int(need_entropy) + 2 * topk
    return torch.cat(parts) if parts else hidden.new_zeros((0, width), dtype=torch.float32)


def chunk_columns(h: torch.Tensor, targets: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                  temperature: float, need_entropy: bool, topk: int) -> torch.Tensor:
    """One chunk of ``chunked_head_columns``: ``h`` ``[c, H]``, ``targets`` ``[c, m]`` -> ``[c, C]``.

    A temperature of 1 divides nothing: ``x / 1`` is ``x``, and skipping it saves a pass over the
    chunk's ``[c, V]`` fp32 logits (each pass is a kernel of its own when eager)."""
    z = head(h).float()
    return head_columns(z if temperature == 1.0 else z / temperature, targets, need_entropy, topk)


_COMPILED: list[Callable[..., torch.Tensor]] = []


def compiled_chunk_columns() -> Callable[..., torch.Tensor]:
    """``chunk_columns`` through ``torch.compile``, made once per process.

    Why: eager, a chunk is the head's GEMM then five passes over its ``[c, V]`` logits (the cast
    to fp32, ``log_softmax``, the gather; in the backward the gather's scatter, the softmax's
    gradient, the cast back), each a kernel that reads or writes the whole chunk. Inductor fuses
    them into one reduction forward and one backward (the gain: docs/training.md). The head's identity, the temperature and the flags are guards of the
    compiled code (a new value compiles again); the chunk's length is dynamic from the start
    (``dynamic=True``, as the layers'): a micro-batch's last chunk is shorter, and with automatic
    dynamic shapes each of the train and infer paths compiled twice."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(chunk_columns, dynamic=True))
    return _COMPILED[0]

