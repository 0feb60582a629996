"""The training half of a policy-gradient update: the clipped loss, ``ppo_epochs`` x mini-batches,
the policy's and a critic's steps side by side. A part the trainers hold.

Why a part: PPO, the critic-free estimators and distillation train a scored batch with its
advantages the same way; only the loss's options differ (distillation's ``topk_coef``).
RNG: the one ``torch.Generator`` of the trainer is passed in by reference (never copied or
reseeded) and draws one ``randperm`` per epoch, so a resumed run continues its draws.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel

from xrlhf.algorithms.critic import Critic
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.data.batch import Batch
from xrlhf.engines.handles import Handle

DROPPED = ("group_ids", "token_versions", "turn_rewards", "truncated")
"""Batch keys the train steps do not read."""


def policy_loss(o: BaseModel, kl_coef: float, on_policy: bool = False, staleness_bins: tuple[int, ...] = (),
                topk_coef: float = 0.0) -> PolicyLoss:
    """The policy's loss from a ``PolicyGradientConfig`` ``o`` and the KL controller's current
    ``kl_coef`` (a loss term only when ``kl_in_reward`` is off); ``on_policy``: the old logprobs are
    the train forward's own, with the mismatch reported by ``staleness_bins``."""
    return PolicyLoss(o.clip_eps, o.clip_eps_high, o.entropy_coef, 0.0 if o.kl_in_reward else kl_coef,
                      o.kl_estimator, o.tis_cap, off_policy=o.off_policy.spec() if o.off_policy is not None else None,
                      log_entropy=o.log_entropy, on_policy=on_policy, staleness_bins=staleness_bins,
                      topk_coef=topk_coef)


class PolicyUpdate:
    """``ppo_epochs`` passes of mini-batch steps over a scored batch with ``advantages``.

    Args:
        policy: the policy handle (``train_step``).
        critic: the ``Critic`` part, or ``None``; its step on each mini-batch is sent before the
            policy's.
        options: the algorithm's ``PolicyGradientConfig`` (``ppo_epochs``, ``mini_batch_size``,
            the loss's options).
        kl: the trainer's KL controller (its ``value`` is read when the loss is built).
        generator: the trainer's generator (the mini-batch shuffle).
        topk_coef: the top-k reverse KL's weight in the loss (distillation).
    """

    def __init__(self, policy: Handle, critic: Critic | None, options: BaseModel, kl, generator: torch.Generator,
                 topk_coef: float = 0.0):
        self.policy, self.critic, self.options, self.kl = policy, critic, options, kl
        self.generator, self.topk_coef = generator, topk_coef

    def loss(self, on_policy: bool = False, staleness_bins: tuple[int, ...] = ()) -> PolicyLoss:
        """The policy's loss now (``policy_loss`` with the controller's coefficient)."""
        return policy_loss(self.options, self.kl.value, on_policy, staleness_bins, self.topk_coef)

    def train(self, batch: Batch, step: int) -> dict[str, float]:
        """Train on ``batch`` (its policy version ``step``: the staleness of an on-policy step);
        returns the steps' metrics averaged over the mini-batches (``sums / n``)."""
        o = self.options
        on_policy = "old_logprobs" not in batch  # Scoring skipped the forward: the trainer reuses the train one
        bins: tuple[int, ...] = ()
        if on_policy and "token_versions" in batch:
            batch["staleness"] = (step - batch["token_versions"].long()).float()
            bins = tuple(sorted(set(batch["staleness"][batch["response_mask"] != 0].long().tolist())))
        loss = self.loss(on_policy, bins)
        sums: dict[str, float] = {}
        n = 0
        keys = [k for k in batch.keys() if k not in DROPPED]
        for _ in range(o.ppo_epochs):
            for mb in self.minibatches(batch.select(*keys), o.mini_batch_size):
                pending = self.critic.train_step(mb) if self.critic is not None else None
                metrics = self.policy.train_step(mb, loss)
                metrics = {("policy/" + k if "/" not in k else k): v for k, v in metrics.items()}
                if pending is not None:
                    metrics.update({("critic/" + k if "/" not in k else k): v for k, v in pending.get().items()})
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n += 1
        out = {k: v / n for k, v in sums.items()}
        return on_policy_metrics(out, batch, bins) if on_policy else out

    def minibatches(self, batch: Batch, size: int) -> list[Batch]:
        """A seeded shuffle of ``batch`` (one ``randperm``) cut into mini-batches of ``size`` rows."""
        perm = torch.randperm(len(batch), generator=self.generator)
        return list(batch.index(perm).chunks(size))


def on_policy_metrics(metrics: dict[str, float], batch: Batch, bins: tuple[int, ...]) -> dict[str, float]:
    """The metrics of an on-policy step's loss (``losses.on_policy_metrics``) in the form the
    old-logprob forward's caller reported them: the mismatch at each staleness (a sum and a count,
    both per token, divided) and ``kl/mean`` (the summed per-token KL, row mean) from the loss's
    per-token ``policy/kl_loss``."""
    for d in bins:
        total, count = metrics.pop(f"mismatch/abs_diff_sum_s{d}", 0.0), metrics.pop(f"mismatch/tokens_s{d}", 0.0)
        if count > 0:
            metrics[f"mismatch/abs_diff_s{d}"] = total / count
    if "policy/kl_loss" in metrics:
        metrics["kl/mean"] = metrics["policy/kl_loss"] * float(batch["response_mask"].sum()) / len(batch)
    return metrics

