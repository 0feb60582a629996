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
from xrlhf.algorithms.offline import OfflineConfig, OfflineTrainer, pair_batch, prefixed
from xrlhf.config.schema import XConfig
from xrlhf.data.datasets import PREFERENCE, DatasetPath, load_rows, split_held_out


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


@register_algorithm("rm")
class RewardModelTrainer(OfflineTrainer):
    """Bradley-Terry reward model on ``{prompt, chosen, rejected}`` rows."""

    Config = RewardModelConfig
    schema = PREFERENCE
    rows_per_item = 2
    needs_reference = False
    policy_head = "score"
    uses_generation = False
    progress_keys = (("policy/loss", "loss"), ("rm/accuracy", "acc"), ("rm/margin", "margin"),
                     ("eval/accuracy", "eval_acc"))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        o = self.options
        if o.eval_dataset is not None:
            eval_rows = load_rows(o.eval_dataset, PREFERENCE)
            self.eval_items = [self.encode_row(r) for r in eval_rows.rows]
        else:
            self.items, self.eval_items = split_held_out(self.items, [row["prompt"] for row in self.rows.rows],
                                                         o.eval_fraction, path=self.rows.path, section="algorithm",
                                                         noun="pairs")
        self.eval_items = self.eval_items[:o.eval_size]

    @classmethod
    def check_config(cls, cfg: XConfig, o: RewardModelConfig) -> list[str]:
        errors = super().check_config(cfg, o)
        if cfg.reference is not None:
            errors.append("reference: a reward model is trained without a reference model; set reference: null")
        if cfg.critic is not None:
            errors.append("critic: a reward model is trained without a critic; remove the critic section")
        return errors

    def encode_row(self, row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        return (self.encode_prompt(row["prompt"]), self.encode_response(row["chosen"]),
                self.encode_response(row["rejected"]))

    def train_on(self, items: list[tuple[list[int], list[int], list[int]]]) -> dict[str, float]:
        batch = pair_batch(*zip(*items), self.tok.pad_token_id)
        return prefixed(self.policy.train_step(batch, PairwiseRewardLoss()))

    def evaluate(self) -> dict[str, float]:
        """Pairwise accuracy and mean margin on the held-out pairs (``eval/reward_mean`` = accuracy)."""
        chosen, rejected = [], []
        size = 64 * self.policy.world_size  # pairs per call: bounds the padded width of a batch
        for start in range(0, len(self.eval_items), size):
            part = self.eval_items[start:start + size]
            scores = self.policy.infer(pair_batch(*zip(*part), self.tok.pad_token_id))["scores"]
            chosen.append(scores[0::2])
            rejected.append(scores[1::2])
        diff = torch.cat(chosen) - torch.cat(rejected)
        acc = float((diff > 0).float().mean())
        return {"eval/reward_mean": acc, "eval/accuracy": acc, "eval/margin": float(diff.mean()),
                "eval/chosen_score_mean": float(torch.cat(chosen).mean())}

    def fit(self) -> dict[str, Any] | None:
        result = super().fit()
        if result is None:  # stopped early (a signal): the runner checkpoints
            return None
        result["summary"] = {"eval_accuracy": result["eval_final"]["eval/accuracy"],
                             "eval_accuracy_initial": result["eval_initial"]["eval/accuracy"],
                             "eval_pairs": len(self.eval_items)}
        return result
