"""Reward-model training: a pairwise Bradley-Terry model from a preference dataset.

The model is the policy's network with a sequence-score head (``policy_head = "score"``, an
HF ``...ForSequenceClassification`` with one label, reading the last non-pad token), trained
on ``{prompt, chosen, rejected}`` rows with::

    loss = -log sigmoid(s(x, y_chosen) - s(x, y_rejected))

Started from a supervised warm-up (``warmup:``), it begins from a network that already reads
the task, as InstructGPT's reward model starts from the SFT model. It needs no generation and
no reference. The eval metric is the pairwise accuracy on held-out pairs
(``algorithm.eval_dataset``, or a deterministic ``eval_fraction`` of the dataset's prompts);
``summary.json`` holds it as ``eval_accuracy`` (and ``eval_reward_*`` = accuracy as well).
``final/`` is an HF directory: name it as ``reward.model`` of another run to use it as the
reward handle (e.g. the ``qa`` environment).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, model_validator

from xrlhf.algorithms.base import register_algorithm
from xrlhf.algorithms.losses import PairwiseRewardLoss
from xrlhf.algorithms.offline import (OfflineConfig, OfflineTrainer, PairStep, offline_errors, offline_steps, pair_batch,
                                      prefixed)
from xrlhf.algorithms.spec import Algorithm
from xrlhf.config.schema import XConfig
from xrlhf.data.datasets import PREFERENCE, DatasetPath, Rows, load_rows, split_held_out


class RewardModelConfig(OfflineConfig):
    """``algorithm:`` section of reward-model training."""

    name: str = "rm"
    eval_dataset: DatasetPath | None = Field(None, description="held-out preference pairs")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="without eval_dataset: share of prompts held out")
    eval_size: int | None = Field(None, ge=1, description="evaluate on at most this many pairs")

    @model_validator(mode="after")
    def _some_eval(self):
        if self.eval_dataset is None and self.eval_fraction == 0:
            raise ValueError("algorithm.eval_fraction: 0 holds no pairs out and there is no "
                             "algorithm.eval_dataset; set one of them")
        return self


class PairAccuracy:
    """The reward model's evaluation: pairwise accuracy and mean margin of its scores on held-out
    pairs (encoded items), and the run summary's ``eval_accuracy``."""

    def __init__(self, policy, pad_id: int, items: list[tuple[list[int], list[int], list[int]]]):
        self.policy, self.pad_id, self.items = policy, pad_id, items

    def evaluate(self, handle=None, runner=None, keep=None) -> dict[str, float]:
        """``eval/accuracy``, ``eval/margin``, ``eval/chosen_score_mean`` of the policy's scores
        (``eval/reward_mean`` = accuracy); ``handle`` is unused (a reward model does not generate)."""
        chosen, rejected = [], []
        size = 64 * self.policy.world_size  # pairs per call: bounds the padded width of a batch
        for start in range(0, len(self.items), size):
            part = self.items[start:start + size]
            scores = self.policy.infer(pair_batch(*zip(*part), self.pad_id))["scores"]
            chosen.append(scores[0::2])
            rejected.append(scores[1::2])
        diff = torch.cat(chosen) - torch.cat(rejected)
        acc = float((diff > 0).float().mean())
        return {"eval/reward_mean": acc, "eval/accuracy": acc, "eval/margin": float(diff.mean()),
                "eval/chosen_score_mean": float(torch.cat(chosen).mean())}

    def summary(self, result: dict[str, Any]) -> dict[str, Any]:
        """``summary.json``'s accuracies before and after, and the number of pairs."""
        return {"eval_accuracy": result["eval_final"]["eval/accuracy"],
                "eval_accuracy_initial": result["eval_initial"]["eval/accuracy"], "eval_pairs": len(self.items)}


class PairwiseStep(PairStep):
    """The Bradley-Terry step on ``{prompt, chosen, rejected}`` rows; its held-out pairs are
    ``eval_dataset``'s or a split of the dataset's prompts."""

    def train_on(self, items: list[tuple[list[int], list[int], list[int]]]) -> dict[str, float]:
        batch = pair_batch(*zip(*items), self.tok.pad_token_id)
        return prefixed(self.policy.train_step(batch, PairwiseRewardLoss()))

    def held_out(self, items: list[Any], rows: Rows) -> tuple[list[Any], PairAccuracy]:
        o = self.options
        if o.eval_dataset is not None:
            eval_items = [self.encode(r) for r in load_rows(o.eval_dataset, PREFERENCE).rows]
        else:
            items, eval_items = split_held_out(items, [row["prompt"] for row in rows.rows], o.eval_fraction,
                                               path=rows.path, section="algorithm", noun="pairs")
        return items, PairAccuracy(self.policy, self.tok.pad_token_id, eval_items[:o.eval_size])


def rm_errors(cfg: XConfig, o: RewardModelConfig) -> list[str]:
    """The reward model's checks besides ``common_errors``: whole pairs, no reference, no critic."""
    errors = offline_errors(cfg, o, PairwiseStep, reference=False)
    if cfg.reference is not None:
        errors.append("reference: a reward model is trained without a reference model; set reference: null")
    if cfg.critic is not None:
        errors.append("critic: a reward model is trained without a critic; remove the critic section")
    return errors


RM = register_algorithm("rm")(Algorithm(
    RewardModelConfig, PairwiseStep, checks=rm_errors, steps=offline_steps, uses_generation=False,
    policy_head="score", schema=PairwiseStep.schema, loop=OfflineTrainer,
    progress_keys=(("policy/loss", "loss"), ("rm/accuracy", "acc"), ("rm/margin", "margin"),
                   ("eval/accuracy", "eval_acc"))))
"""A Bradley-Terry reward model: an ``OfflineTrainer`` with a ``PairwiseStep`` and ``PairAccuracy``."""
