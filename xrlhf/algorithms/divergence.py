"""Per-token divergences of a student to a teacher, from the logprobs of the tokens the student
sampled: the dense signal of on-policy distillation (``algorithms/distill.py``).

Why only the sampled tokens: an engine returns the logprob of each response token (``[B, R]``),
never the ``[B, R, V]`` distributions (a 150k vocabulary would make them gigabytes). That is
enough for an exact policy gradient of both divergences here. For a student ``p`` that sampled
token ``y`` where the teacher gives ``q``, the gradient of a per-position divergence ``D(p, q)``
is ``E_{y~p}[c(y) * grad log p(y)]`` with a per-token *cost* ``c`` (the derivation is in
docs/design/distill-divergence.md):

* reverse KL ``KL(p || q)``: ``c = log p(y) - log q(y)``; its mean under ``p`` is the KL itself;
* generalized JSD (GKD's ``JSD(beta)``, Agarwal et al. 2024, TRL's ``generalized_jsd_loss``):
  ``D = beta KL(q || m) + (1 - beta) KL(p || m)`` with ``m = beta q + (1 - beta) p``;
  ``c = (1 - beta) (log p(y) - log m(y))``, and the one-sample estimate of ``D`` is
  ``c + beta (q(y) / p(y)) (log q(y) - log m(y))``.

The advantage of a token is ``-c`` (plus, optionally, a task reward's advantage): the GRPO
family's clipped loss and off-policy correction then apply unchanged. Conventions are
``functional``'s: ``[B, R]`` float tensors, a ``mask`` with 1 on the tokens the student wrote
(0 on padding and on an episode's environment tokens), results 0 where the mask is 0.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from xrlhf.algorithms.functional import masked_mean

Divergence = Literal["reverse_kl", "jsd"]

MAX_LOG_RATIO = 20.0
"""``log q - log p`` is clamped to ``[-20, 20]`` before ``exp`` in the JSD estimate (as the IS
weights of ``off_policy``): the weight only keeps a 0 * inf from becoming nan on padding."""

__all__ = ["Divergence", "token_cost", "divergence_estimate", "distill_advantages", "split_by_correct",
           "topk_reverse_kl"]

TAIL_FLOOR = 1e-8
"""The tail masses ``1 - sum_K`` are floored here before their logs: a top-k that holds all the
mass (to float precision) would otherwise make the tail term or its gradient infinite."""


def _real(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in (logprobs, teacher_logprobs, mask)}
    if len(shapes) > 1:
        raise ValueError(f"logprobs, teacher_logprobs and mask must have one shape, got {sorted(shapes)}")
    return mask != 0


def _log_mixture(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """``log m = log(beta q + (1 - beta) p)`` per token, computed in log space."""
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    return torch.logaddexp(teacher_logprobs + math.log(beta), logprobs + math.log(1 - beta))


def token_cost(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
               divergence: Divergence = "reverse_kl", beta: float = 0.5) -> torch.Tensor:
    """The per-token cost ``c`` whose policy gradient is the divergence's (module docstring).

    Args:
        logprobs: ``[B, R]`` the student's log-probs of its own sampled tokens.
        teacher_logprobs: ``[B, R]`` the teacher's log-probs of the same tokens.
        mask: ``[B, R]`` 1 on the tokens the student wrote.
        divergence: ``reverse_kl`` (``c = log p - log q``) or ``jsd``
            (``c = (1 - beta) (log p - log m)``, ``m = beta q + (1 - beta) p``).
        beta: the JSD's teacher weight in ``(0, 1)``; 0.5 is the symmetric JSD.
    Returns:
        ``[B, R]``, 0 where ``mask`` is 0. Detached inputs give a detached result.
    """
    real = _real(logprobs, teacher_logprobs, mask)
    if divergence == "reverse_kl":
        cost = logprobs - teacher_logprobs
    elif divergence == "jsd":
        cost = (1 - beta) * (logprobs - _log_mixture(logprobs, teacher_logprobs, beta))
    else:
        raise ValueError(f"divergence must be 'reverse_kl' or 'jsd', got {divergence!r}")
    return torch.where(real, cost, torch.zeros_like(cost))


def divergence_estimate(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                        divergence: Divergence = "reverse_kl", beta: float = 0.5) -> torch.Tensor:
    """A one-sample estimate of the per-position divergence from the student's sampled token
    (unbiased under the student's own distribution; it can be negative for one token).

    reverse KL: ``log p - log q`` (Schulman's k1). JSD: ``(1 - beta) log(p / m) + beta (q / p)
    log(q / m)`` (the teacher's half importance-weighted by ``q / p``).

    Args:
        logprobs, teacher_logprobs, mask: ``[B, R]`` as in ``token_cost``.
        divergence, beta: as in ``token_cost``.
    Returns:
        ``[B, R]`` nats per token, 0 where ``mask`` is 0.
    """
    real = _real(logprobs, teacher_logprobs, mask)
    if divergence != "jsd":
        return token_cost(logprobs, teacher_logprobs, mask, divergence, beta)
    log_m = _log_mixture(logprobs, teacher_logprobs, beta)
    weight = torch.exp((teacher_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    est = (1 - beta) * (logprobs - log_m) + beta * weight * (teacher_logprobs - log_m)
    return torch.where(real, est, torch.zeros_like(est))


def distill_advantages(cost: torch.Tensor, mask: torch.Tensor, task_advantages: torch.Tensor | None = None,
                       task_weight: float = 0.0) -> torch.Tensor:
    """``A = -c + task_weight * A_task`` per token: the distillation signal, plus a task reward's
    advantage (from a critic-free estimator: GRPO's group-normalised scores on every token).

    Args:
        cost: ``[B, R]`` ``token_cost``.
        mask: ``[B, R]``.
        task_advantages: ``[B, R]`` or ``None`` (then ``task_weight`` must be 0).
        task_weight: the task advantage's weight.
    Returns:
        ``[B, R]`` float, 0 where ``mask`` is 0.
    """
    if tuple(cost.shape) != tuple(mask.shape):
        raise ValueError(f"cost {tuple(cost.shape)} and mask {tuple(mask.shape)} must have one shape")
    adv = -cost
    if task_weight:
        if task_advantages is None or tuple(task_advantages.shape) != tuple(mask.shape):
            raise ValueError("task_weight != 0 needs task_advantages of the mask's shape [B, R]")
        adv = adv + task_weight * task_advantages
    return torch.where(mask != 0, adv, torch.zeros_like(adv)).float()


def split_by_correct(per_token: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
    """Token means of ``per_token`` over all rows, the rows judged right and those judged wrong.

    Args:
        per_token: ``[B, R]`` values (e.g. ``divergence_estimate``).
        mask: ``[B, R]``.
        correct: ``[B]`` bool, the student's answer was right.
    Returns:
        ``{"mean", "right", "wrong"}``; a split without rows is left out (no 0 that reads as a
        measurement).
    """
    out = {"mean": float(masked_mean(per_token, mask))}
    rows = correct.bool().unsqueeze(1).expand_as(mask)
    for name, keep in (("right", rows), ("wrong", ~rows)):
        m = mask * keep
        if bool((m != 0).any()):
            out[name] = float(masked_mean(per_token, m))
    return out


def topk_reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
                    ) -> torch.Tensor:
    """The reverse KL ``KL(p || q)`` of student ``p`` to teacher ``q`` per position, over the
    teacher's top-k tokens ``K`` and one bucket for the rest of the vocabulary::

        sum_{y in K} p_y (log p_y - log q_y) + p_tail (log p_tail - log q_tail),
        p_tail = 1 - sum_K p_y,  q_tail = 1 - sum_K q_y

    It is a lower bound of the full reverse KL (the tail bucket merges tokens, the data-processing
    inequality) and equals it when ``K`` is the whole vocabulary. Unlike ``token_cost`` it is the
    divergence itself, differentiable in the student's logprobs: no score function, no sampling
    noise (docs/design/distill-divergence.md, "Top-k: the plan").

    Args:
        student_logprobs: ``[B, R, k]`` the student's logprobs at the teacher's top-k ids
            (``ForwardOutput.gathered``), with gradients.
        teacher_logprobs: ``[B, R, k]`` the teacher's top-k logprobs (``topk_logprobs``).
        mask: ``[B, R]`` 1 on the tokens the student wrote.
    Returns:
        ``[B, R]`` nats, 0 where ``mask`` is 0.
    """
    if student_logprobs.shape != teacher_logprobs.shape or tuple(student_logprobs.shape[:2]) != tuple(mask.shape):
        raise ValueError(f"student {tuple(student_logprobs.shape)} and teacher {tuple(teacher_logprobs.shape)} "
                         f"logprobs must be [B, R, k] of the mask's [B, R] {tuple(mask.shape)}")
    p, q = student_logprobs.exp(), teacher_logprobs.exp()
    head = (p * (student_logprobs - teacher_logprobs)).sum(-1)
    p_tail = (1 - p.sum(-1)).clamp(min=0)
    q_tail = (1 - q.sum(-1)).clamp(min=TAIL_FLOOR)
    tail = p_tail * (p_tail.clamp(min=TAIL_FLOOR).log() - q_tail.log())  # finite gradient at p_tail = 0
    kl = head + tail
    return torch.where(mask != 0, kl, torch.zeros_like(kl))
