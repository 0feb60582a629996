"""The policy-gradient update: PPO's, the critic-free estimators' and distillation's, one part.

Why one: the three differ only in where the advantages come from (``algorithms/advantage.py``)
and in what distillation adds before them (the teacher's scores, GKD's rows). One update, in
the paper's order::

    rows      <- the rollout (+ teacher completions)           (distill: OfflineRows)
    teacher   <- teacher logprobs                               (distill: Teacher)
    score     <- old and reference logprobs, KL, values         (Scoring)
    advantage <- the family's part                              (GAE, GroupEstimator, distill's)
    train     <- ppo_epochs x mini-batches of the clipped loss  (PolicyUpdate)
    KL        <- the controller's update
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from xrlhf.algorithms import functional as F
from xrlhf.algorithms.base import Rollout, differing_rewards
from xrlhf.algorithms.critic import Critic
from xrlhf.algorithms.policy_update import PolicyUpdate
from xrlhf.algorithms.scoring import Scoring
from xrlhf.data.batch import Batch

AdvantageStep = Callable[["PolicyGradient", Rollout, int], dict[str, float]]
"""``(update, rollout, n_rollout) -> metrics``: writes ``advantages`` (and ``returns``) into
``rollout.batch``, whose first ``n_rollout`` rows are the rollout's own."""


class PolicyGradient:
    """The policy-gradient update of an ``RLTrainer`` (``loop``).

    Args:
        loop: the trainer (its handles, ``generator``, ``timeline``, ``step_idx``, ``run``).
        options: a ``PolicyGradientConfig``.
        advantage: the family's ``Advantage`` part (``self.advantage``).
        step: the ``AdvantageStep`` that applies it (``advantage_step``, ``gae_step``, distill's).
        critic: the ``Critic`` part (PPO: values scored, the critic trained beside the policy), or
            ``None``.
        teacher: distillation's ``Teacher`` part (its handle is evaluated once with
            ``run.teacher_evaluates``), or ``None``.
        rows: distillation's ``OfflineRows``, or ``None``.
        topk_coef: the loss's top-k reverse KL weight.
    """

    def __init__(self, loop, options, advantage, step: AdvantageStep, critic: Critic | None = None, teacher=None,
                 rows=None, topk_coef: float = 0.0):
        o = self.options = options
        self.loop, self.advantage, self.step, self.critic = loop, advantage, step, critic
        self.teacher, self.rows, self.teacher_eval = teacher, rows, None
        self.kl_ctl = (F.AdaptiveKLController(o.kl_coef, o.kl_target, o.kl_horizon) if o.kl_target
                       else F.FixedKLController(o.kl_coef))
        self.scoring = Scoring(loop.policy, loop.reference if o.kl_coef > 0 else None, critic, o.kl_estimator)
        self.policy_update = PolicyUpdate(loop.policy, critic, o, self.kl_ctl, loop.generator,
                                          topk_coef=topk_coef)

    def __call__(self, rollout: Rollout, timings: dict[str, float]) -> dict[str, float]:
        batch = rollout.batch
        n_rollout = len(batch)
        if self.rows is not None:
            batch = rollout.batch = self.rows.extend(batch, self.loop.step_idx)
        metrics = self.teacher.score(batch, timings) if self.teacher is not None else {}
        metrics.update(self.score_logprobs(batch, timings))
        metrics.update(self.step(self, rollout, n_rollout))
        t0 = time.time()
        metrics.update(self.train_epochs(batch))
        timings["time/train_s"] = time.time() - t0
        self.kl_ctl.update(metrics.get("kl/mean", 0.0), len(batch))
        if self.critic is not None:
            metrics.update(self.critic.metrics(batch, metrics))
        return metrics

    def reuses_train_forward(self, batch: Batch) -> bool:
        """Whether the update of ``batch`` is one on-policy step: one epoch over one mini-batch,
        no dropout, no KL needed before the advantages (``kl_in_reward`` off or ``kl_coef`` 0), and
        no teacher (distillation's advantages need the student's logprobs first). The "old"
        policy is then the one the train step starts from, so no forward computes its logprobs:
        the loss takes the train forward's own (``PolicyLoss.on_policy``; the same loss and
        gradient) and reports the mismatch metrics that forward's caller would have. TRL and verl
        skip it there too. The reference's and a critic's forwards still run."""
        o = self.options
        return (self.teacher is None and o.ppo_epochs == 1 and o.mini_batch_size >= len(batch)
                and not self.loop.run.policy_dropout and (not o.kl_in_reward or o.kl_coef == 0))

    def score_logprobs(self, batch: Batch, timings: dict[str, float]) -> dict[str, float]:
        """Old logprobs (unless ``reuses_train_forward``), reference logprobs (and critic values)
        for ``batch``, in parallel (``Scoring``); then ``kl/coef``."""
        loop = self.loop
        with loop.timeline.span("trainer", "infer"):
            metrics = self.scoring.score(batch, loop.step_idx, timings, self.reuses_train_forward(batch))
            loop.mark_memory("infer")
            metrics["kl/coef"] = self.kl_ctl.value
            return metrics

    def train_epochs(self, batch: Batch) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch steps; policy and critic step side by side (``PolicyUpdate``)."""
        with self.loop.timeline.span("trainer", "train"):
            return self.policy_update.train(batch, self.loop.step_idx)

    def advantages(self, rollout: Rollout) -> torch.Tensor:
        """``[B, R]`` advantages of the rollout (``old_logprobs`` / ``kl`` already in its batch)."""
        return self.advantage.compute(rollout.batch, self.kl_ctl.value)["advantages"]

    def keeps_group(self, scores: torch.Tensor) -> bool:
        return differing_rewards(scores)

    def evaluation(self) -> dict[str, float]:
        """The teacher's evaluation (``eval/teacher_*``), computed once: its weights never change."""
        if self.teacher is None:
            return {}
        if self.teacher_eval is None and self.teacher.handle is not None and self.loop.run.teacher_evaluates:
            loop = self.loop
            runner_for, handle = loop.evaluator.runner_for, self.teacher.handle
            m = loop.evaluator.evaluate(handle, runner_for(handle) if loop.episodes is not None else None)
            self.teacher_eval = {k.replace("eval/", "eval/teacher_", 1): v for k, v in m.items()}
        return self.teacher_eval or {}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kl_ctl": self.kl_ctl.state_dict()}
        if self.teacher is not None:
            state["teacher_eval"] = self.teacher_eval
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.teacher is not None:
            self.teacher_eval = state.get("teacher_eval")


def advantage_step(update: PolicyGradient, rollout: Rollout, n_rollout: int) -> dict[str, float]:
    """The ``advantage`` part's advantages (a critic-free estimator's, yours), with
    ``advantages/mean`` and ``advantages/abs_mean``."""
    batch = rollout.batch
    batch["advantages"] = update.advantages(rollout)
    mask = batch["response_mask"]
    return {"advantages/mean": float(F.masked_mean(batch["advantages"], mask)),
            "advantages/abs_mean": float(F.masked_mean(batch["advantages"].abs(), mask))}


def gae_step(update: PolicyGradient, rollout: Rollout, n_rollout: int) -> dict[str, float]:
    """PPO's advantages and returns (``GAE``)."""
    batch = rollout.batch
    out = update.advantage.compute(batch, update.kl_ctl.value)
    batch["advantages"], batch["returns"] = out["advantages"], out["returns"]
    return {}
