"""Tensor helpers shared by the engine and algorithm layers (no Ray, no model code)."""

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
