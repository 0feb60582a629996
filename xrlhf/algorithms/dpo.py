"""DPO (Rafailov et al. 2023, "Direct Preference Optimization") from a preference dataset.

One step, as in the paper::

    pairs (x, y_w, y_l)                  <- the next batch_size rows of {prompt, chosen, rejected}
    log pi_ref(y_w | x), log pi_ref(y_l | x)          <- reference handle (frozen)
    loss = -log sigmoid(beta * [(log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))])
    (+ nll_weight * mean token NLL of y_w: RPO, Pang et al. 2024; 0 by default)
    one optimizer step of the policy on the mean loss over pairs

The policy is evaluated like every trainer: greedy answers on the env's held-out prompts.
"""

from __future__ import annotations

from pydantic import Field

from xrlhf.algorithms.base import register_algorithm
from xrlhf.algorithms.losses import DPOLoss
from xrlhf.algorithms.offline import (OfflineConfig, OfflineTrainer, PairStep, offline_errors, offline_steps, pair_batch,
                                      prefixed, sequence_logps)
from xrlhf.algorithms.spec import Algorithm
from xrlhf.config.schema import XConfig


class DPOConfig(OfflineConfig):
    """``algorithm:`` section of DPO."""

    name: str = "dpo"
    beta: float = Field(0.1, gt=0, description="strength of the implicit KL to the reference")
    nll_weight: float = Field(0.0, ge=0, description="RPO: weight of the chosen responses' mean token NLL "
                                                     "(0: plain DPO)")


class DPOStep(PairStep):
    """DPO's step: the sigmoid loss on ``{prompt, chosen, rejected}`` rows."""

    def train_on(self, items: list[tuple[list[int], list[int], list[int]]]) -> dict[str, float]:
        prompts, chosen, rejected = zip(*items)
        batch = pair_batch(prompts, chosen, rejected, self.tok.pad_token_id)
        batch["ref_logps"] = sequence_logps(self.reference, batch)
        return prefixed(self.policy.train_step(batch, DPOLoss(self.options.beta, self.options.nll_weight)))


def dpo_errors(cfg: XConfig, o: DPOConfig) -> list[str]:
    """DPO's checks besides ``common_errors``: whole pairs, a reference."""
    return offline_errors(cfg, o, DPOStep, reference=True)


DPO = register_algorithm("dpo")(Algorithm(
    DPOConfig, DPOStep, checks=dpo_errors, steps=offline_steps, schema=DPOStep.schema, loop=OfflineTrainer,
    progress_keys=(("policy/loss", "loss"), ("dpo/reward_accuracy", "acc"), ("dpo/reward_margin", "margin"),
                   ("dpo/chosen_logp_change", "d_chosen"), ("dpo/rejected_logp_change", "d_rejected"))))
"""DPO on ``{prompt, chosen, rejected}`` rows: an ``OfflineTrainer`` with a ``DPOStep``."""
