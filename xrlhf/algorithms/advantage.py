"""Where a policy-gradient update's advantages come from: one part per family.

Why parts: PPO, the critic-free estimators and distillation run the same scoring and training
(``algorithms/scoring.py``, ``algorithms/policy_update.py``) and differ here only. Each part's
``compute`` reads a scored batch (``scores``, ``response_mask``, ``kl``, ...) and returns the
tensors to put in it; it changes nothing itself and draws no random numbers.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from xrlhf.algorithms import divergence as D
from xrlhf.algorithms import functional as F
from xrlhf.algorithms.estimators import ADVANTAGE_ESTIMATORS
from xrlhf.data.batch import Batch


class Advantage(Protocol):
    """``compute(batch, kl_coef) -> {"advantages": [B, R], ...}`` from a scored batch; ``kl_coef``
    is the KL controller's current coefficient."""

    def compute(self, batch: Batch, kl_coef: float) -> dict[str, torch.Tensor]: ...


class GAE:
    """PPO's: token rewards (the score on the last token, or an episode's turn rewards, minus
    ``kl_coef`` x KL when ``kl_in_reward``) and the critic's ``old_values`` through GAE; the
    advantages whitened (then masked) when ``whiten``. Returns ``advantages`` and ``returns``."""

    def __init__(self, gamma: float, lam: float, whiten: bool, kl_in_reward: bool):
        self.gamma, self.lam, self.whiten, self.kl_in_reward = gamma, lam, whiten, kl_in_reward

    def compute(self, batch: Batch, kl_coef: float) -> dict[str, torch.Tensor]:
        mask = batch["response_mask"]
        kl_coef = kl_coef if self.kl_in_reward else 0.0
        if "turn_rewards" in batch:  # an episode env: each turn's reward on the token that earned it
            rewards = F.kl_penalized_rewards(torch.zeros_like(batch["scores"]), batch["kl"], mask, kl_coef)
            rewards = rewards + batch["turn_rewards"] * (mask != 0)
        else:
            rewards = F.kl_penalized_rewards(batch["scores"], batch["kl"], mask, kl_coef)
        adv, ret = F.gae(rewards, batch["old_values"], mask, self.gamma, self.lam)
        return {"advantages": F.masked_whiten(adv, mask) * mask if self.whiten else adv, "returns": ret}


class GroupEstimator:
    """A registered estimator (``algorithms.estimators``) over the batch's ``scores`` and
    ``group_ids``; with ``kl_in_reward`` and ``kl_coef > 0`` the KL as per-token rewards. The
    advantages are masked, then whitened when ``whiten``.

    Args:
        name: the estimator's registered name or import path (``ADVANTAGE_ESTIMATORS``).
    """

    def __init__(self, name: str, gamma: float, kl_in_reward: bool, whiten: bool):
        self.name, self.gamma, self.kl_in_reward, self.whiten = name, gamma, kl_in_reward, whiten
        self.estimator: Callable = ADVANTAGE_ESTIMATORS.get(name)

    def compute(self, batch: Batch, kl_coef: float) -> dict[str, torch.Tensor]:
        mask = batch["response_mask"]
        token_rewards = None
        if self.kl_in_reward and kl_coef > 0:
            token_rewards = F.kl_penalized_rewards(batch["scores"], batch["kl"], mask, kl_coef)
        adv = self.estimator(batch["scores"], mask, batch["group_ids"], gamma=self.gamma, token_rewards=token_rewards)
        if tuple(adv.shape) != tuple(mask.shape):
            raise ValueError(f"advantage estimator {self.name!r} returned shape {tuple(adv.shape)}, "
                             f"expected [B, R] = {tuple(mask.shape)}")
        adv = adv.float() * mask
        return {"advantages": F.masked_whiten(adv, mask) if self.whiten else adv}


class DistillAdvantage:
    """Distillation's: ``-c_t`` (the divergence's per-token cost of the student's ``old_logprobs``
    to ``teacher_logprobs``) on the student's own tokens, plus ``weight`` x the ``task``
    estimator's advantage; whitened over those tokens when ``whiten``. Rows of teacher
    completions (``on_policy`` 0 on them) get +1 per token: the NLL of the teacher's tokens.

    Args:
        divergence: ``reverse_kl`` or ``jsd`` (``divergence.token_cost``); ``jsd_beta`` its beta.
        task: the task reward's ``GroupEstimator``, or ``None`` (``weight`` 0).
    """

    def __init__(self, divergence: str, jsd_beta: float, task: GroupEstimator | None, weight: float, whiten: bool):
        self.divergence, self.jsd_beta, self.task, self.weight, self.whiten = divergence, jsd_beta, task, weight, whiten

    def compute(self, batch: Batch, kl_coef: float, teacher: torch.Tensor | None = None,
                on_policy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``teacher``: ``[B, R]`` the teacher's logprobs (default ``batch["teacher_logprobs"]``);
        ``on_policy``: ``[B, R]`` 1 on the student's own tokens (default ``response_mask``)."""
        mask = batch["response_mask"]
        teacher = batch["teacher_logprobs"] if teacher is None else teacher
        on_policy = mask if on_policy is None else on_policy
        cost = D.token_cost(batch["old_logprobs"], teacher, on_policy, self.divergence, self.jsd_beta)
        task = self.task.compute(batch, kl_coef)["advantages"] if self.task is not None else None
        adv = D.distill_advantages(cost, on_policy, task, self.weight)
        if self.whiten:  # a baseline: the batch mean is no function of any one sampled token
            adv = F.masked_whiten(adv, on_policy)
        return {"advantages": adv + (mask - on_policy)}
