"""Pure tensor-in/tensor-out pieces of the RLHF algorithms: masked reductions, GAE, the PPO
policy and value losses, KL estimators and controllers, and the KTO / DPO / reward-model losses.

Why a module of free functions: every number a trainer optimises is computed here, so each one
can be checked against hand-computed values on a 1x3 tensor, without a model, Ray or a GPU.
The trainer loops then read like the papers' pseudocode.

Conventions:
    * ``B`` rows (sequences), ``R`` response positions. Per-token tensors are ``[B, R]`` float,
      with a ``mask`` ``[B, R]`` float: 1 on a real response token, 0 on padding (or on tokens
      the policy did not generate, such as environment observations in a multi-turn rollout).
    * Losses return ``(loss_sum, stats)``: ``loss_sum`` is a SUM over masked tokens (or rows);
      the engine divides by the global token (or row) count so micro-batches and data-parallel
      ranks of different sizes weigh every token equally. ``stats`` maps names to detached
      0-dim tensors (means), ready to be all-reduced and logged.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from xrlhf.utils.tensors import entropy_from_logits  # noqa: F401  (re-exported)

WHITEN_EPS = 1e-8
# exp() of a log-ratio above this overflows float16/bfloat16 ranges and means the sample is
# hopelessly off-policy anyway; the clip only guards against inf * 0 = nan.
_MAX_LOG_RATIO = 20.0

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_whiten",
    "place_on_last_token",
    "discounted_returns",
    "gae",
    "policy_loss",
    "value_loss",
    "kl_estimate",
    "kl_penalized_rewards",
    "entropy_from_logits",
    "masked_entropy_mean",
    "FixedKLController",
    "AdaptiveKLController",
    "kto_reference_point",
    "kto_loss",
    "kto_balanced_desirable_weights",
    "dpo_loss",
    "bradley_terry_loss",
    "sequence_logprob",
]


# ---------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {', '.join(f'{n}={s}' for n, s in shapes.items())}")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x * mask``; positions with mask 0 count as 0 even if ``x`` is inf/nan there.

    Args:
        x: ``[B, R]`` (any shape) values.
        mask: same shape as ``x``, float weights (1 = real token).
        dim: reduce this dimension only; ``None`` reduces everything to a scalar.
    Returns:
        a scalar, or ``x`` with ``dim`` removed.
    """
    x = torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)) * mask
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is non-zero (weighted by ``mask``).

    An all-zero mask gives 0, not nan.

    Args:
        x: ``[B, R]`` (any shape) values.
        mask: same shape as ``x``.
        dim: reduce this dimension only; ``None`` reduces everything to a scalar.
    Returns:
        a scalar, or ``x`` with ``dim`` removed.
    """
    total = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / total.clamp_min(1e-8)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over the masked positions.

    Variance is the biased (``unbiased=False``) masked variance; ``eps`` = 1e-8 under the sqrt.

    Args:
        x: ``[B, R]`` values.
        mask: ``[B, R]``.
        shift_mean: if False the mean is added back (only the scale is normalised).
    Returns:
        ``[B, R]``; positions with mask 0 are 0.
    """
    _check_same_shape(x=x, mask=mask)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask != 0, whitened, torch.zeros_like(whitened))


def place_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each row's sequence score on its last masked token.

    Args:
        scores: ``[B]`` one score per sequence.
        mask: ``[B, R]``.
    Returns:
        ``[B, R]``: ``scores[b]`` at the last position where ``mask[b] != 0``, 0 elsewhere
        (a row with an all-zero mask gets nothing).
    """
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores must be [B]={tuple(mask.shape[:1])}, got {tuple(scores.shape)}")
    real = mask != 0
    R = mask.shape[1]
    last = R - 1 - real.flip(-1).int().argmax(-1)  # first real position counted from the end
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has_token = real.any(-1)
    out.scatter_(1, last.unsqueeze(1), torch.where(has_token, scores, 0.0).unsqueeze(1))
    return out


# ---------------------------------------------------------------------------------------------
# Advantages and returns
# ---------------------------------------------------------------------------------------------


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over the masked tokens of each row.

    Unmasked positions are skipped: their reward is ignored and ``G`` is carried across them
    unchanged, so trailing padding acts as the terminal state and an interior masked span
    (e.g. environment tokens) does not break the chain.

    Args:
        rewards: ``[B, R]`` per-token rewards.
        mask: ``[B, R]``.
        gamma: discount.
    Returns:
        ``[B, R]`` returns, 0 where mask is 0.
    """
    _check_same_shape(rewards=rewards, mask=mask)
    real = mask != 0
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(real[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(real[:, t], running, 0.0)
    return out


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016).

    ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    where ``values[:, t]`` is ``V(s_t)``, the value before token ``t``. The episode ends after
    the last masked token (``V`` beyond it is 0). Unmasked positions get advantage 0 and are
    skipped: the next real token's value and advantage are carried across them, so interior
    masked spans (environment tokens of a multi-turn rollout) are bridged, not terminal.

    Args:
        rewards: ``[B, R]`` per-token rewards (e.g. from ``kl_penalized_rewards``).
        values: ``[B, R]`` critic values.
        mask: ``[B, R]``.
        gamma: discount; lam: GAE lambda.
    Returns:
        ``(advantages, returns)``, both ``[B, R]`` and without gradient;
        ``returns = advantages + values``.
    """
    _check_same_shape(rewards=rewards, values=values, mask=mask)
    real = mask != 0
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(real[:, t], adv_t, next_adv)
        next_value = torch.where(real[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(real[:, t], adv_t, 0.0)
    return advantages, advantages + values


# ---------------------------------------------------------------------------------------------
# PPO losses
# ---------------------------------------------------------------------------------------------


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_eps: float, clip_eps_high: float | None = None,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017), summed over masked tokens.

    Per token: ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)`` with
    ``ratio = exp(logprobs - old_logprobs)``, times ``is_weights`` if given.

    Args:
        logprobs: ``[B, R]`` log-probs of the sampled tokens under the current policy (grad).
        old_logprobs: ``[B, R]`` the same under the policy that is being improved upon.
        advantages: ``[B, R]``.
        mask: ``[B, R]``.
        clip_eps: lower clip range; ``clip_eps_high`` the upper one (default ``clip_eps``;
            a larger value is DAPO's "clip-higher").
        is_weights: optional ``[B, R]`` importance weights (e.g. truncated
            ``pi_old / pi_rollout`` correcting a rollout engine's numerics); used detached.
    Returns:
        ``(loss_sum, stats)``. stats, means over masked tokens: ``clip_frac`` (fraction of
        tokens where the clipped branch is the one taken), ``approx_kl`` (Schulman's k3
        estimator of KL(pi_old || pi): ``ratio - 1 - log(ratio)``, always >= 0),
        ``ratio_mean``.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                      mask=mask)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    if is_weights is not None:
        _check_same_shape(is_weights=is_weights, mask=mask)
        per_token = per_token * is_weights.detach()
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return masked_sum(per_token, mask), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip_eps: float | None) -> tuple[torch.Tensor, dict]:
    """Clipped value loss, summed over masked tokens.

    Per token: ``0.5 * max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2)``; with
    ``clip_eps=None`` plainly ``0.5 * (v - R)^2``.

    Args:
        values: ``[B, R]`` current critic values (grad).
        old_values: ``[B, R]`` critic values at rollout time.
        returns: ``[B, R]`` targets (e.g. from ``gae``).
        mask: ``[B, R]``.
        clip_eps: value clip range, or ``None`` for no clipping.
    Returns:
        ``(loss_sum, stats)``; stats: ``vf_clip_frac`` (fraction of masked tokens where the
        clip acted and the clipped error is the larger one), ``value_mean``.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    err = (values - returns) ** 2
    if clip_eps is None:
        per_token = err
        clipped_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(err, err_clipped)
        # only where the clamp acted: elsewhere old + (v - old) differs from v by one rounding,
        # and comparing the two errors would count float noise as clipping
        clipped = ((values - old_values).abs() > clip_eps) & (err_clipped > err)
        clipped_frac = masked_mean(clipped.float(), mask).detach()
    stats = {"vf_clip_frac": clipped_frac, "value_mean": masked_mean(values.detach(), mask)}
    return 0.5 * masked_sum(per_token, mask), stats


# ---------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                estimator: Literal["k1", "k2", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman, 2020,
    "Approximating KL Divergence").

    With ``d = ref_logprobs - logprobs``: ``k1 = -d`` (unbiased, can be negative),
    ``k2 = 0.5 * d^2`` (biased, low variance), ``k3 = exp(d) - d - 1`` (unbiased, >= 0).

    Args:
        logprobs: ``[B, R]`` log-probs of the sampled tokens under the policy.
        ref_logprobs: ``[B, R]`` the same under the reference model.
        estimator: "k1", "k2" or "k3".
    Returns:
        ``[B, R]``, not masked.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d ** 2
    if estimator == "k3":
        d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: 'k1', 'k2', 'k3'")


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                         kl_coef: float) -> torch.Tensor:
    """Token rewards for PPO-style RLHF: ``-kl_coef * kl`` on every masked token, plus the
    sequence score on the last masked token of each row.

    Args:
        scores: ``[B]`` sequence scores (reward model or verifier).
        kl: ``[B, R]`` per-token KL estimates (``kl_estimate``).
        mask: ``[B, R]``.
        kl_coef: penalty coefficient (``KLController.value``).
    Returns:
        ``[B, R]``, 0 where mask is 0.
    """
    _check_same_shape(kl=kl, mask=mask)
    penalty = torch.where(mask != 0, -kl_coef * kl, torch.zeros_like(kl))
    return penalty + place_on_last_token(scores.to(kl.dtype), mask)


class FixedKLController:
    """A constant KL coefficient. ``update`` does nothing; kept for a uniform interface."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences": ``err = clip(KL / target - 1, -0.2, 0.2)``,
    ``coef *= 1 + err * n_steps / horizon``.

    Args:
        init_coef: starting coefficient.
        target: the KL (nats per sequence, or whatever unit ``update`` receives) to steer to.
        horizon: number of samples over which a full-size correction acts.
    """

    def __init__(self, init_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target > 0 and horizon > 0, "
                             f"got target={target}, horizon={horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` toward ``target`` after ``n_steps`` samples of mean KL ``current_kl``."""
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = state.get("horizon", self.horizon)


# ---------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------


def masked_entropy_mean(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean token entropy over masked positions.

    Args:
        logits: ``[B, R, V]``.
        mask: ``[B, R]``.
    Returns:
        scalar.
    """
    return masked_mean(entropy_from_logits(logits), mask)


# ---------------------------------------------------------------------------------------------
# Sequence-level preference losses
# ---------------------------------------------------------------------------------------------


def sequence_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of each response: the sum of its masked token log-probs.

    Args:
        logprobs: ``[B, R]``; mask: ``[B, R]``.
    Returns:
        ``[B]``.
    """
    _check_same_shape(logprobs=logprobs, mask=mask)
    return masked_sum(logprobs, mask, dim=-1)


def kto_reference_point(policy_logps_mismatched: torch.Tensor,
                        ref_logps_mismatched: torch.Tensor) -> torch.Tensor:
    """KTO's reference point ``z_ref`` (Ethayarajh et al. 2024), a batch estimate of
    KL(pi || pi_ref): ``max(0, mean(policy - ref))`` over MISMATCHED pairs (completion ``y_j``
    scored under prompt ``x_i``, ``i != j``), detached: no gradient flows through it.

    Under data parallelism the mean should be over the global batch: all-reduce the inputs'
    sums, or average the returned values, before using it.

    Args:
        policy_logps_mismatched: ``[B]`` sequence log-probs under the policy.
        ref_logps_mismatched: ``[B]`` the same under the reference model.
    Returns:
        scalar.
    """
    _check_same_shape(policy_logps_mismatched=policy_logps_mismatched,
                      ref_logps_mismatched=ref_logps_mismatched)
    return (policy_logps_mismatched - ref_logps_mismatched).mean().clamp(min=0).detach()


def _mean_or_zero(x: torch.Tensor) -> torch.Tensor:
    return x.mean() if x.numel() else torch.zeros((), dtype=x.dtype, device=x.device)


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor,
             z_ref: torch.Tensor | float, beta: float, desirable_weight: float | torch.Tensor,
             undesirable_weight: float | torch.Tensor) -> tuple[torch.Tensor, dict]:
    """KTO loss (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
    Optimization"), summed over rows.

    With ``r = policy_logps - ref_logps``: a desirable row costs
    ``w_d * (1 - sigmoid(beta * (r - z_ref)))``, an undesirable one
    ``w_u * (1 - sigmoid(beta * (z_ref - r)))``.

    Args:
        policy_logps: ``[B]`` sequence log-probs under the policy (grad).
        ref_logps: ``[B]`` the same under the reference model.
        labels: ``[B]`` bool, True = desirable.
        z_ref: scalar reference point (``kto_reference_point``).
        beta: temperature; desirable_weight / undesirable_weight: ``w_d`` / ``w_u``, scalars or
            ``[B]`` per-row weights (``kto_balanced_desirable_weights``).
    Returns:
        ``(loss_sum, stats)``; stats: ``rewards_chosen`` / ``rewards_rejected`` (mean implicit
        reward ``beta * r`` of desirable / undesirable rows, 0.0 when there are none), ``kl``
        (= ``z_ref``).
    """
    _check_same_shape(policy_logps=policy_logps, ref_logps=ref_logps, labels=labels)
    labels = labels.bool()
    z = torch.as_tensor(z_ref, dtype=policy_logps.dtype, device=policy_logps.device).detach()
    r = policy_logps - ref_logps
    desirable = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z)))
    undesirable = undesirable_weight * (1.0 - torch.sigmoid(beta * (z - r)))
    loss_sum = torch.where(labels, desirable, undesirable).sum()
    rewards = (beta * r).detach()
    stats = {
        "rewards_chosen": _mean_or_zero(rewards[labels]),
        "rewards_rejected": _mean_or_zero(rewards[~labels]),
        "kl": z,
    }
    return loss_sum, stats


def kto_balanced_desirable_weights(labels: torch.Tensor, group_ids: torch.Tensor, ratio: float,
                                   undesirable_weight: float) -> torch.Tensor:
    """Desirable weights ``w_d`` that make ``w_d * n_d / (w_u * n_u) = ratio`` within each group.

    KTO (Ethayarajh et al. 2024, section 4.2) recommends ``w_d n_d / (w_u n_u)`` in ``[1, 4/3]``,
    ``n_d`` / ``n_u`` the counts of desirable / undesirable examples. Online, the counts change
    from batch to batch and from prompt to prompt (a hard prompt gets 1 right answer in 8, an
    easy one 7), so fixed weights drift out of that range; this computes ``w_d`` from the
    actual counts of each group. One group for the whole batch (``group_ids`` all equal) is the
    paper's batch-level rule; one group per prompt keeps the rule within every prompt's samples
    that have both labels. A group without one of the classes has no ratio to keep:
    ``w_d = ratio * w_u`` there, and then the batch-level ratio is *not* kept (ratio 1.33, group
    A 8/8 desirable, group B 1/8: the batch gets ``(8 * 1.33 + 9.31) / 7 = 2.85``).

    Args:
        labels: ``[B]`` bool, True = desirable.
        group_ids: ``[B]`` the group (e.g. prompt) of each row.
        ratio: the wanted ``w_d n_d / (w_u n_u)``.
        undesirable_weight: ``w_u``.
    Returns:
        ``[B]`` float: the ``w_d`` of each row's group (used by the desirable rows only).
    """
    _check_same_shape(labels=labels, group_ids=group_ids)
    labels = labels.bool()
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    n_d = torch.zeros(len(groups)).index_add(0, inverse, labels.float())
    n_u = torch.bincount(inverse, minlength=len(groups)).float() - n_d
    w = torch.where((n_d > 0) & (n_u > 0), ratio * undesirable_weight * n_u / n_d.clamp(min=1),
                    torch.full_like(n_d, ratio * undesirable_weight))
    return w[inverse]


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, dict]:
    """DPO sigmoid loss (Rafailov et al. 2023), summed over pairs:
    ``-logsigmoid(beta * ((pc - rc) - (pr - rr)))``.

    Args:
        policy_chosen, policy_rejected: ``[B]`` sequence log-probs under the policy (grad).
        ref_chosen, ref_rejected: ``[B]`` the same under the reference model.
        beta: temperature.
    Returns:
        ``(loss_sum, stats)``; stats: ``reward_accuracy`` (fraction of pairs whose implicit
        chosen reward ``beta * (pc - rc)`` is strictly above the rejected one),
        ``reward_margin`` (mean chosen minus rejected implicit reward).
    """
    _check_same_shape(policy_chosen=policy_chosen, policy_rejected=policy_rejected,
                      ref_chosen=ref_chosen, ref_rejected=ref_rejected)
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    margin = chosen_rewards - rejected_rewards
    loss_sum = -F.logsigmoid(margin).sum()
    margin = margin.detach()
    stats = {"reward_accuracy": (margin > 0).float().mean(), "reward_margin": margin.mean()}
    return loss_sum, stats


def bradley_terry_loss(chosen_scores: torch.Tensor,
                       rejected_scores: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Bradley-Terry reward-model loss, summed over pairs: ``-logsigmoid(c - r)``.

    Args:
        chosen_scores, rejected_scores: ``[B]`` scalar rewards of each pair's two responses.
    Returns:
        ``(loss_sum, stats)``; stats: ``accuracy`` (fraction with ``c > r``), ``margin``
        (mean ``c - r``).
    """
    _check_same_shape(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    diff = chosen_scores - rejected_scores
    loss_sum = -F.logsigmoid(diff).sum()
    diff = diff.detach()
    return loss_sum, {"accuracy": (diff > 0).float().mean(), "margin": diff.mean()}
