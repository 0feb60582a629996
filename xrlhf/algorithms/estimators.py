"""Critic-free advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++), chosen by name.

Why a registry: these estimators differ only in how a batch of sequence scores becomes
per-token advantages, so the trainer loop stays one loop and the YAML picks the estimator
(``algorithm.advantage_estimator: rloo``), or names the user's own function by import path
(``my_pkg.adv:my_estimator``).

Every estimator has the same signature::

    fn(scores [B] float, mask [B, R], group_ids [B] long, *, gamma=1.0,
       token_rewards: [B, R] | None = None, eps=1e-6) -> advantages [B, R]

``group_ids[b]`` names the prompt that row ``b`` answers; rows with equal ids form a group
(ids need not be contiguous or sorted). Advantages are 0 where ``mask`` is 0. The group
estimators (grpo, dr_grpo, rloo) use outcome scores only and ignore ``gamma`` and
``token_rewards``; a per-token KL penalty with them belongs in the loss, not the reward.
"""

from __future__ import annotations

import torch

from xrlhf.algorithms.functional import discounted_returns, masked_whiten, place_on_last_token
from xrlhf.utils.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "group_ids_for",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
]


def group_ids_for(n_prompts: int, n_samples: int, device: torch.device | str | None = None
                  ) -> torch.Tensor:
    """Group ids for a batch laid out prompt-major: the ``n_samples`` samples of prompt 0,
    then those of prompt 1, ...

    Returns:
        ``[n_prompts * n_samples]`` long, e.g. ``(2, 3) -> [0, 0, 0, 1, 1, 1]``.
    """
    return torch.arange(n_prompts, device=device).repeat_interleave(n_samples)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group statistics: (group sum, group size, group mean), each ``[B]``."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores and group_ids must both be [B], got "
                         f"{tuple(scores.shape)} and {tuple(group_ids.shape)}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    sums.index_add_(0, inverse, scores)
    counts = torch.bincount(inverse, minlength=n_groups).to(scores.dtype)
    row_sum, row_count = sums[inverse], counts[inverse]
    return row_sum, row_count, row_sum / row_count


def _broadcast(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, R]`` on masked tokens, 0 elsewhere."""
    if mask.dim() != 2 or mask.shape[0] != adv.shape[0]:
        raise ValueError(f"mask must be [B, R] with B={adv.shape[0]}, got {tuple(mask.shape)}")
    return torch.where(mask != 0, adv.unsqueeze(1).to(mask.dtype), torch.zeros_like(mask))


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(scores: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, *,
         gamma: float = 1.0, token_rewards: torch.Tensor | None = None,
         eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(s - mean_g) / (std_g + eps)``.

    ``std_g`` is the UNBIASED group standard deviation (``torch.std`` default, divides by
    ``n - 1``), as in the paper and TRL. A group of one sample gets advantage 0.

    Args / Returns: see the module docstring; ``[B] -> [B, R]``.
    """
    _, count, mean = _group_stats(scores, group_ids)
    centered = scores - mean
    _, _, sq_sum_mean = _group_stats(centered ** 2, group_ids)
    var = sq_sum_mean * count / (count - 1).clamp_min(1)
    adv = centered / (var.sqrt() + eps)
    return _broadcast(torch.where(count > 1, adv, torch.zeros_like(adv)), mask)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(scores: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, *,
            gamma: float = 1.0, token_rewards: torch.Tensor | None = None,
            eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``s - mean_g``,
    without the std division (which over-weights near-uniform groups).

    Args / Returns: see the module docstring; ``[B] -> [B, R]``.
    """
    _, _, mean = _group_stats(scores, group_ids)
    return _broadcast(scores - mean, mask)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(scores: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, *,
         gamma: float = 1.0, token_rewards: torch.Tensor | None = None,
         eps: float = 1e-6) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): ``s_i - mean(s_j for j != i in the group)``, the
    leave-one-out baseline. A group of one sample gets advantage 0.

    Args / Returns: see the module docstring; ``[B] -> [B, R]``.
    """
    total, count, _ = _group_stats(scores, group_ids)
    others_mean = (total - scores) / (count - 1).clamp_min(1)
    adv = torch.where(count > 1, scores - others_mean, torch.zeros_like(scores))
    return _broadcast(adv, mask)


def _reinforce_pp_from_scores(scores: torch.Tensor, mask: torch.Tensor, gamma: float,
                              token_rewards: torch.Tensor | None) -> torch.Tensor:
    if token_rewards is None:
        token_rewards = place_on_last_token(scores, mask)
    elif token_rewards.shape != mask.shape:
        raise ValueError(f"token_rewards must be [B, R]={tuple(mask.shape)}, "
                         f"got {tuple(token_rewards.shape)}")
    returns = discounted_returns(token_rewards.to(mask.dtype), mask, gamma)
    return masked_whiten(returns, mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(scores: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, *,
                 gamma: float = 1.0, token_rewards: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): per-token discounted return ``G_t = r_t + gamma * G_{t+1}``,
    whitened over all masked tokens of the whole batch (``masked_whiten``).

    ``token_rewards``, if given, are the complete per-token rewards and must already contain
    the score (e.g. ``kl_penalized_rewards(scores, kl, mask, coef)``); ``scores`` is then
    unused. Without it the score is placed on each row's last masked token.
    ``group_ids`` and ``eps`` are unused.

    Args / Returns: see the module docstring; ``[B] -> [B, R]``.
    """
    return _reinforce_pp_from_scores(scores, mask, gamma, token_rewards)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(scores: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, *,
                          gamma: float = 1.0, token_rewards: torch.Tensor | None = None,
                          eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with a group baseline: the group mean score is subtracted from each
    row's score (on its last masked token) first, then as ``reinforce_pp`` (discounted
    return, global whitening over the batch).

    With ``token_rewards`` given (which already hold the score), the group mean of
    ``scores`` is subtracted on the last masked token of ``token_rewards``.

    Args / Returns: see the module docstring; ``[B] -> [B, R]``.
    """
    _, _, mean = _group_stats(scores, group_ids)
    if token_rewards is None:
        return _reinforce_pp_from_scores(scores - mean, mask, gamma, None)
    baselined = token_rewards - place_on_last_token(mean.to(token_rewards.dtype), mask)
    return _reinforce_pp_from_scores(scores, mask, gamma, baselined)
