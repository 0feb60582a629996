"""The forwards of a policy-gradient update before its advantages: a part the trainers hold.

Why a part: PPO, the critic-free estimators and distillation all score a rollout the same way
(old logprobs, reference logprobs and the KL, a critic's values, the mismatch to the sampler),
and differ only in what they make of it (``algorithms/advantage.py``).
"""

from __future__ import annotations

import time

import torch

from xrlhf.algorithms import functional as F
from xrlhf.algorithms.critic import Critic
from xrlhf.algorithms.off_policy import staleness_metrics, staleness_stats
from xrlhf.data.batch import Batch
from xrlhf.engines.handles import Handle


class Scoring:
    """Old logprobs, reference logprobs with the KL, and critic values of a batch, in parallel.

    Args:
        policy: the policy handle (its ``infer`` gives the old logprobs).
        reference: the reference handle, or ``None`` (no KL: ``kl_coef`` 0 or no reference).
        critic: the ``Critic`` part, or ``None`` (no values: the critic-free families).
        kl_estimator: ``k1`` / ``k2`` / ``k3`` (``functional.kl_estimate``).
    """

    def __init__(self, policy: Handle, reference: Handle | None, critic: Critic | None, kl_estimator: str):
        self.policy, self.reference, self.critic, self.kl_estimator = policy, reference, critic, kl_estimator

    def score(self, batch: Batch, step: int, timings: dict[str, float], reuse: bool) -> dict[str, float]:
        """Writes ``old_logprobs`` (unless ``reuse``: the train forward's own are used), ``ref_logprobs``,
        ``kl`` and (with a critic) ``old_values``, all ``[B, R]``, into ``batch``; ``step`` is the
        policy version the batch trains (for the staleness metrics). Returns the metrics."""
        t0 = time.time()
        old = None
        if not reuse:
            old = self.policy.infer(batch.select("input_ids", "attention_mask", "response_mask"), wait=False)
        ref = self.reference.infer(batch, wait=False) if self.reference is not None else None
        val = self.critic.values(batch) if self.critic is not None else None
        mask = batch["response_mask"]
        metrics = {}
        if old is not None:
            batch["old_logprobs"] = old.get()["logprobs"]
            metrics.update(mismatch(batch, step))
        elif "token_versions" in batch:  # the mismatch by staleness comes from the train step
            metrics.update(staleness_stats(batch["token_versions"], mask, step))
        if ref is not None:
            batch["ref_logprobs"] = ref.get()["logprobs"]
        if ref is not None and old is not None:
            kl = F.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], self.kl_estimator)
            batch["kl"] = kl * mask
            metrics["kl/mean"] = float((batch["kl"].sum(-1)).mean())
        else:  # no reference, or the KL is the loss's (kl/mean from its kl_loss, policy_update.on_policy_metrics)
            batch["kl"] = torch.zeros_like(mask)
        if val is not None:
            batch["old_values"] = val.get()["values"] * mask
        timings["time/infer_s"] = time.time() - t0
        return metrics


def mismatch(batch: Batch, step: int) -> dict[str, float]:
    """The old logprobs against the rollout's (and by staleness against version ``step``, for
    asynchronous rollouts); none without ``rollout_logprobs``."""
    if "rollout_logprobs" not in batch:
        return {}
    mask = batch["response_mask"]
    diff = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * mask
    out = {"mismatch/logprob_abs_diff_mean": float(diff.sum() / mask.sum().clamp(min=1)),
           "mismatch/logprob_abs_diff_max": float(diff.max())}
    if "token_versions" in batch:
        out.update(staleness_metrics(batch["old_logprobs"], batch["rollout_logprobs"], batch["token_versions"],
                                     mask, step))
    return out
