"""Off-policy correction: importance weights of the proximal over the behaviour policy, and the
staleness metrics of an asynchronous rollout.

Why a module: once generation runs ahead of training (``rollout.max_staleness`` > 0) a rollout's
tokens were sampled by an older policy than the one being improved, and even at staleness 0 the
generator's numerics differ from the trainer's. Three policies are then in play (decoupled PPO,
Hilton et al. 2022; AReaL; verl's "decoupled mode"):

* the *behaviour* policy ``pi_behav``, which sampled the tokens: ``rollout_logprobs``;
* the *proximal* policy ``pi_prox``, the policy at the start of the update, recomputed by the
  trainer: ``old_logprobs``. PPO's clip stays around it;
* the current policy ``pi_theta`` (the one with gradients).

The PPO ratio ``pi_theta / pi_prox`` is unchanged; the policy-gradient term of each token is
multiplied by a behaviour weight ``w = pi_prox / pi_behav`` that corrects for having sampled
from ``pi_behav``. ``is_weights`` computes ``w`` and what ``algorithm.off_policy`` makes of it
(truncate or mask, per token or per sequence); ``staleness_metrics`` measures how stale a
rollout is. Pure functions on ``[B, R]`` tensors (``functional``'s conventions), in a module of
their own because ``functional.py`` is near its size limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from xrlhf.algorithms.functional import masked_mean, masked_sum

MAX_LOG_WEIGHT = 20.0
"""``log w`` is clamped to ``[-20, 20]`` before ``exp`` (verl's ``SAFETY_BOUND`` in
``rollout_corr_helper.py``, slime's in ``examples/train_infer_mismatch_helper/mis.py``):
``exp(20)`` ~ 4.9e8 is still finite in float32 and a weight that far from 1 is truncated or masked
anyway; the clamp only keeps a sequence's sum of hundreds of log-ratios from overflowing to
``inf`` (and ``inf * 0`` to nan)."""

Correction = Literal["none", "tis", "mis"]
Level = Literal["token", "sequence"]


@dataclass(frozen=True)
class OffPolicy:
    """The off-policy options ``PolicyLoss`` applies (``algorithm.off_policy`` in YAML).

    A frozen dataclass of plain values, so a loss holding it pickles to Ray workers.

    Attributes:
        correction: ``none`` (weight 1: measure only), ``tis`` (truncate ``w`` at ``cap``) or
            ``mis`` (mask the tokens, or whole sequences, whose ``w`` is outside ``bounds``).
        level: ``token`` (one weight per token) or ``sequence`` (the product over the
            response, the same on each of its tokens).
        cap: ``tis``'s truncation ``w <- min(w, cap)``.
        bounds: ``mis``'s ``(lo, hi)``: kept where ``lo <= w <= hi``.
    """

    correction: Correction = "tis"
    level: Level = "token"
    cap: float = 2.0
    bounds: tuple[float, float] = (0.5, 2.0)


def _log_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                 level: str) -> torch.Tensor:
    """``[B, R]`` clamped ``log w``: per token, or each row's masked sum broadcast to its tokens."""
    real = mask != 0
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    diff = torch.where(real, old_logprobs - rollout_logprobs, zero)  # padding may hold -inf - -inf
    if level == "sequence":
        diff = masked_sum(diff, mask, dim=-1).unsqueeze(-1).expand_as(diff)
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    return diff.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)


def is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
               correction: Correction = "tis", level: Level = "token", cap: float = 2.0,
               bounds: tuple[float, float] = (0.5, 2.0)
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Behaviour importance weights ``w = pi_prox / pi_behav`` and the tokens to keep.

    ``log w_t = old_logprobs_t - rollout_logprobs_t`` per token (``level="token"``), or
    ``log w = sum_t mask_t (old_t - rollout_t)`` per row (``level="sequence"``: the product of the
    token weights, one weight on each of the row's tokens); ``log w`` is clamped to
    ``[-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT]`` before ``exp``. Then:

    * ``none``: ``weights = 1``, ``keep = 1`` (the stats still measure the raw ``w``);
    * ``tis`` (truncated IS; Yao et al. 2025): ``weights = min(w, cap)``, ``keep = 1``;
    * ``mis`` (masked IS): ``keep = lo <= w <= hi`` (bounds inclusive, per token or for the whole
      row) and ``weights = w`` where kept, 0 where not. A kept weight is *not* truncated further:
      it is already at most ``hi``. (The peers' definitions, and why this one is theirs:
      docs/design/async-rl.md, "Off-policy corrections in the peers".)

    Positions with ``mask == 0`` get ``weights = keep = 1`` (neutral; the loss masks them).
    Nothing here carries a gradient.

    Args:
        old_logprobs: ``[B, R]`` proximal-policy log-probs (the policy at the start of the update).
        rollout_logprobs: ``[B, R]`` behaviour-policy log-probs (what the generator sampled with).
        mask: ``[B, R]`` response mask.
        correction: ``none``, ``tis`` or ``mis``.
        level: ``token`` or ``sequence``.
        cap: ``tis``'s upper truncation, > 0.
        bounds: ``mis``'s ``(lo, hi)`` with ``0 <= lo < hi``.
    Returns:
        ``(weights [B, R], keep [B, R] float 0/1, stats)``; stats are 0-dim tensors, means over
        the response tokens (token-weighted by ``mask``, so a sequence-level decision counts once
        per token of its row): ``clipped_frac`` (weight truncated: ``tis`` with ``w > cap``),
        ``masked_frac`` (``keep == 0``), ``weight_mean`` (the raw ``w`` before truncation or
        masking).
    """
    if correction not in ("none", "tis", "mis"):
        raise ValueError(f"correction must be 'none', 'tis' or 'mis', got {correction!r}")
    shapes = {tuple(t.shape) for t in (old_logprobs, rollout_logprobs, mask)}
    if len(shapes) > 1:
        raise ValueError(f"old_logprobs, rollout_logprobs and mask must have one shape, got {sorted(shapes)}")
    with torch.no_grad():
        real = mask != 0
        w = torch.exp(_log_weights(old_logprobs, rollout_logprobs, mask, level))
        one = torch.ones_like(w)
        clipped = torch.zeros_like(w)
        weights, keep = one, one
        if correction == "tis":
            if cap <= 0:
                raise ValueError(f"cap must be > 0, got {cap}")
            clipped = (w > cap).to(w.dtype)
            weights = torch.where(real, w.clamp(max=cap), one)
        elif correction == "mis":
            lo, hi = bounds
            if not 0 <= lo < hi:
                raise ValueError(f"bounds must satisfy 0 <= lo < hi, got {tuple(bounds)}")
            kept = ((w >= lo) & (w <= hi)) | ~real
            keep = kept.to(w.dtype)
            weights = torch.where(real, torch.where(kept, w, torch.zeros_like(w)), one)
        stats = {"clipped_frac": masked_mean(clipped, mask), "masked_frac": masked_mean(1.0 - keep, mask),
                 "weight_mean": masked_mean(w, mask)}
    return weights, keep, stats


def staleness_stats(token_versions: torch.Tensor, mask: torch.Tensor, policy_version: int) -> dict[str, float]:
    """``staleness/min|mean|max`` of ``policy_version - token_versions`` over the response tokens
    (``[B, R]`` each), and ``staleness/mixed_frac``: the fraction of sequences whose tokens were
    sampled by more than one version (an in-flight update landed while they generated, and they
    went on: ``on_update`` continue or recompute); zeros for an all-padding batch."""
    real = mask != 0
    if not bool(real.any()):
        return {"staleness/min": 0.0, "staleness/mean": 0.0, "staleness/max": 0.0, "staleness/mixed_frac": 0.0}
    versions = token_versions.long()
    stale = (policy_version - versions)[real]
    rows = real.any(dim=1)
    newest = torch.where(real, versions, torch.full_like(versions, torch.iinfo(torch.long).min)).amax(dim=1)
    oldest = torch.where(real, versions, torch.full_like(versions, torch.iinfo(torch.long).max)).amin(dim=1)
    mixed = ((newest != oldest) & rows).sum() / rows.sum()
    return {"staleness/min": float(stale.min()), "staleness/mean": float(stale.double().mean()),
            "staleness/max": float(stale.max()), "staleness/mixed_frac": float(mixed)}


def staleness_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, token_versions: torch.Tensor,
                      mask: torch.Tensor, policy_version: int) -> dict[str, float]:
    """How stale a rollout's tokens are, and the logprob mismatch at each staleness.

    The staleness of a token is ``policy_version - token_versions``: how many policy versions
    the sampler was behind the policy being trained. Its ``d = 0`` bucket of
    ``mismatch/abs_diff_s{d}`` is the pure engine-numerics mismatch; larger ``d`` add the drift of
    ``d`` updates.

    Args:
        old_logprobs: ``[B, R]`` proximal-policy log-probs.
        rollout_logprobs: ``[B, R]`` behaviour-policy log-probs.
        token_versions: ``[B, R]`` int, the policy version that sampled each token (0 on padding).
        mask: ``[B, R]`` response mask.
        policy_version: the version of the policy being trained.
    Returns:
        ``staleness/min``, ``staleness/mean``, ``staleness/max`` over the response tokens, and
        ``mismatch/abs_diff_s{d}`` (mean ``|old - rollout|`` over the response tokens of staleness
        ``d``) for every ``d`` present. An all-padding batch gives zeros and no ``mismatch`` keys.
    """
    out = staleness_stats(token_versions, mask, policy_version)
    real = mask != 0
    if not bool(real.any()):
        return out
    stale = (policy_version - token_versions.long())[real]
    diff = (old_logprobs - rollout_logprobs).abs()[real].double()
    for d in sorted(set(stale.tolist())):
        out[f"mismatch/abs_diff_s{d}"] = float(diff[stale == d].mean())
    return out
