"""An algorithm is a registration: its options, what the run needs of it, and the part it gives
its loop: the ``update`` of the one ``RLTrainer``, or the step part of the ``OfflineTrainer``
(STYLE 19: the varying part is passed in).

``Algorithm`` keeps the old trainer classes' attributes under their names and signatures
(``Config``, ``needs_critic``, ``check_config(cfg, o)``, ``train_steps(cfg, o)``, ...), so the
validation, the topology and the runner read a registration as they read a class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

from xrlhf.algorithms.base import RL_PROGRESS, RLTrainer, Trainer, common_errors
from xrlhf.config.schema import XConfig
from xrlhf.data.datasets import RowSchema
from xrlhf.engines.base import Head


@dataclass(frozen=True)
class Algorithm:
    """One algorithm (``register_algorithm(name)(Algorithm(...))``).

    Args:
        Config: the ``algorithm:`` section's options (pydantic, unknown keys rejected).
        parts: ``(options, trainer) -> part``: an online loop's ``Update``, built from the
            trainer's handles, generator and timeline, or an offline loop's step part
            (``offline.RowStep``); it draws no random numbers.
        checks: ``(cfg, options) -> [error lines]`` besides ``common_errors``.
        steps: ``(cfg, options) -> {handle: optimizer steps}``; default one per step.
        behaviour_logprobs: ``options -> bool``: whether the update reads the sampler's logprobs
            (``rollout_logprobs``: an importance weight); else a generator whose logprobs cost
            throughput (vLLM) returns none.
        loop: the trainer class that runs it (``RLTrainer``, or a subclass that measures more;
            ``OfflineTrainer`` for a dataset).
    """

    Config: type[BaseModel]
    parts: Callable[[Any, Any], Any]
    checks: Callable[[XConfig, Any], list[str]] | None = None
    steps: Callable[[XConfig, Any], dict[str, int]] | None = None
    behaviour_logprobs: Callable[[Any], bool] | None = None
    needs_critic: bool = False
    uses_teacher: bool = False
    learns_off_policy: bool = False
    """Whether the update can train on samples of older policies (``rollout.max_staleness`` > 0)."""
    uses_generation: bool = True
    policy_head: Head = "causal_lm"
    progress_keys: tuple[tuple[str, str], ...] = RL_PROGRESS
    schema: RowSchema | None = None
    """The row format of the ``algorithm:`` section's dataset options (validate checks every row)."""
    loop: type[Trainer] = RLTrainer

    def check_config(self, cfg: XConfig, options: BaseModel) -> list[str]:
        """Cross-section checks; each returned line names the YAML path and the fix."""
        return common_errors(self, cfg) + (self.checks(cfg, options) if self.checks is not None else [])

    def train_steps(self, cfg: XConfig, options: BaseModel) -> dict[str, int]:
        """Optimizer steps each trainable handle will take (for LR schedules)."""
        if self.steps is not None:
            return self.steps(cfg, options)
        return {"policy": cfg.trainer.steps, "critic": cfg.trainer.steps}

    def reads_behaviour_logprobs(self, cfg: XConfig, options: BaseModel) -> bool:
        """Whether the update reads the sampler's logprobs (``behaviour_logprobs``)."""
        return self.behaviour_logprobs is not None and self.behaviour_logprobs(options)
