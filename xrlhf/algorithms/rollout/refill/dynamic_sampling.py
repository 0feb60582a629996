"""DAPO's dynamic sampling (Yu et al. 2025): keep only groups the algorithm can learn from.

A group whose samples all got the same reward gives a group-relative estimator no signal; the
algorithm's ``group_filter`` says which groups to drop (GRPO: equal rewards; online KTO: one
label only). Rounds generate the missing groups until ``need`` are kept or
``max_generated_factor * need`` were generated; the batch is then completed with the last
dropped groups (``sampling/filled_groups``).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from xrlhf.algorithms.rollout.refill.base import REFILLS, Refill
from xrlhf.algorithms.rollout.types import Group


class DynamicSamplingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_generated_factor: float = Field(3.0, ge=1, description="stop generating at this many times "
                                        "trainer.prompts_per_step groups; the batch is then filled with the last "
                                        "dropped groups (counted in sampling/filled_groups)")


@REFILLS.register("dynamic_sampling")
class DynamicSampling(Refill):
    """Drops the groups ``keep`` refuses and generates more prompts until the batch is full."""

    Options = DynamicSamplingOptions
    min_samples_per_prompt = 2  # a group of one sample never has unequal rewards

    def next_round(self, kept: int, generated: int) -> int:
        cap = max(self.need, math.floor(self.options.max_generated_factor * self.need))
        return min(self.need - kept, cap - generated) if kept < self.need and generated < cap else 0

    def accepts(self, group: Group) -> bool:
        return self.keep(group.scores)

    def complete(self, kept: list[Group], dropped: list[Group], generated: int) -> tuple[list[Group], dict[str, float]]:
        filled = self.need - len(kept)
        groups = kept + (dropped[len(dropped) - filled:] if filled else [])
        return groups, {"sampling/generated_groups": float(generated),
                        "sampling/kept_fraction": (self.need - filled) / generated,
                        "sampling/overgeneration": generated / self.need,
                        "sampling/filled_groups": float(filled)}
