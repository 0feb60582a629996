"""``Collector``: the only way a batch is built, one-turn or episodes, streamed or not, refilled or not.

A batch is built in rounds from the env's training prompts at the data position: the sampler
(``SingleTurn`` or ``Episodes``) generates and scores ``n`` samples of each prompt of a round,
the refill policy (``rollout.refill``) keeps or sets aside each group and says how many prompts
the next round needs, then the kept groups are assembled into one ``Rollout``. The producer
(``rollout/producer.py``) calls it for every batch of every schedule.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from loguru import logger

from xrlhf.algorithms.rollout.refill import Refill
from xrlhf.algorithms.rollout.types import Group, Rollout, Tally
from xrlhf.data.batch import Batch
from xrlhf.envs import Env, Prompt


class Sampler(Protocol):
    """Generates and scores groups (``SingleTurn``, ``Episodes``)."""

    def groups(self, prompts: list[Prompt], b: int, attempt: int, tally: Tally) -> list[Group]: ...

    def assemble(self, groups: list[Group]) -> tuple[Batch, dict[str, float]]: ...


class Collector:
    """Collects batch ``b`` from data position ``pos`` (see the module docstring).

    Args:
        env: the environment (its ``train_prompts``).
        sampler: generates and scores the groups of a round.
        refill: the batch's refill policy (its ``need`` is the groups per batch).
    """

    def __init__(self, env: Env, sampler: Sampler, refill: Refill):
        self.env, self.sampler, self.refill = env, sampler, refill

    def __call__(self, b: int, pos: int, on_generated: Callable[[], None]) -> tuple[Rollout, int]:
        """Batch ``b`` from data position ``pos``; calls ``on_generated()`` once its last generate
        call is done (scoring may still run). Returns it and the data position after it."""
        kept: list[Group] = []
        dropped: list[Group] = []
        tally = Tally()
        generated, attempt = 0, 0
        while (m := self.refill.next_round(len(kept), generated)) > 0:
            logger.debug(f"rollout: batch {b} round {attempt}: generating prompts {pos}..{pos + m - 1}")
            for g in self.sampler.groups(self.env.train_prompts(pos, m), b, attempt, tally):
                (kept if self.refill.accepts(g) else dropped).append(g)
            pos, generated, attempt = pos + m, generated + m, attempt + 1
        logger.debug(f"rollout: batch {b} generated ({generated} prompts, {len(kept)} groups kept)")
        on_generated()
        groups, refill_metrics = self.refill.complete(kept, dropped, generated)
        rollout = self.assemble(groups, tally, generated)
        rollout.metrics.update(refill_metrics)
        return rollout, pos

    def assemble(self, groups: list[Group], tally: Tally, generated: int) -> Rollout:
        """One ``Rollout`` of the groups, in order (``group_ids`` 0 .. len(groups) - 1); reward
        metrics are means over the ``generated`` groups."""
        n = len(groups[0].tokens)
        batch, metrics = self.sampler.assemble(groups)
        scores = torch.cat([g.scores for g in groups])
        batch["scores"] = scores
        batch["group_ids"] = torch.arange(len(groups)).repeat_interleave(n)
        n_tokens = float(batch["response_mask"].sum())
        lengths = batch["attention_mask"].sum(dim=1).double() if "attention_mask" in batch else torch.zeros(0)
        metrics = {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                   "response/length_mean": n_tokens / len(batch),
                   "perf/gen_tokens_per_s": tally.tokens / max(tally.generate_s, 1e-9),
                   "perf/sequence_tokens": float(lengths.sum()), "perf/sequence_tokens_sq": float((lengths ** 2).sum()),
                   "time/generate_s": tally.generate_s, "time/reward_s": tally.reward_s,
                   **{k: v / generated for k, v in tally.reward_metrics.items()}, **metrics}
        return Rollout(batch, [g.prompt for g in groups for _ in range(n)], [t for g in groups for t in g.texts],
                       metrics)
