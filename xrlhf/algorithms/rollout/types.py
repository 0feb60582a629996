"""What a rollout is made of: scored groups of samples, and the batch a trainer's update receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xrlhf.config.schema import XConfig
from xrlhf.data.batch import Batch
from xrlhf.engines.base import SamplingParams
from xrlhf.envs import Prompt

Reward = Callable[[list[Prompt], list[str], Batch], tuple[torch.Tensor, dict]]
"""``(prompts, responses, batch) -> (scores [B], metrics)``: the run's reward source."""


@dataclass
class Rollout:
    """One step's samples: the ``Batch`` (layout of ``xrlhf.data.batch``) and their texts.

    ``batch`` holds ``input_ids``, ``attention_mask``, ``response_mask``, ``rollout_logprobs``
    (when the rollout asked for them: ``Sampling.params.logprobs``), ``token_versions`` ``[B, R]`` (the policy version that sampled each response token, 0 on
    padding and on environment tokens), ``scores`` ``[B]`` and ``group_ids`` ``[B]`` (the
    prompt each sample came from); an episode env's also ``turn_rewards`` ``[B, R]`` and
    ``truncated`` ``[B]``.
    """

    batch: Batch
    prompts: list[Prompt]
    responses: list[str]
    metrics: dict[str, float] = field(default_factory=dict)

    def prompt_indices(self) -> list[int]:
        """The index (``Prompt.index``, its position in the training stream) of each group's
        prompt, in order: what the step trains on (``prompts`` in its metrics row, which a resumed
        run's rows must match). Rows without a prompt (a distillation's offline rows) are not counted."""
        ids = self.batch["group_ids"].tolist() if "group_ids" in self.batch else list(range(len(self.prompts)))
        return [p.index for i, (p, g) in enumerate(zip(self.prompts, ids)) if i == 0 or g != ids[i - 1]]


@dataclass
class Group:
    """The ``n`` samples of one prompt, scored (``trajs``: an episode env's trajectories)."""

    prompt: Prompt
    prompt_ids: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    texts: list[str]
    scores: torch.Tensor
    trajs: list[Any] | None = None


@dataclass
class Tally:
    """What collecting one batch cost and what its reward source reported, summed over its
    rounds and parts (means are taken when the batch is assembled)."""

    generate_s: float = 0.0
    reward_s: float = 0.0
    tokens: float = 0.0
    reward_metrics: dict[str, float] = field(default_factory=dict)

    def add_reward_metrics(self, metrics: dict[str, Any], prompts: int) -> None:
        """Add a part's reward metrics (means over the part), weighted by its prompts."""
        for k, v in metrics.items():
            self.reward_metrics[k] = self.reward_metrics.get(k, 0.0) + float(v) * prompts


@dataclass(frozen=True)
class Sampling:
    """How a batch is sampled: ``n`` samples per prompt with ``params``, seeded from ``seed``.

    Attributes:
        n: samples per prompt (``trainer.samples_per_prompt``).
        params: the sampling parameters of the rollout (``policy.generate``).
        seed: the run's seed (every sample's stream is ``sample_seed(seed, batch, row, round)``).
        parts: the batch is generated in this many parts, each scored as it returns
            (``rollout.stream_rewards`` / ``stream_parts``; 1: no streaming).
        model: the policy's model directory (named by the prompt-length check).
    """

    n: int
    params: SamplingParams
    seed: int
    parts: int = 1
    model: str = ""


def sampling_params(cfg: XConfig, temperature: float | None = None, logprobs: bool = True) -> SamplingParams:
    """The rollout's sampling parameters (``policy.generate``, ``rollout``); ``temperature``
    replaces the section's (an evaluation's); ``logprobs``: return the sampled tokens' logprobs."""
    g = cfg.policy.generate
    return SamplingParams(temperature=g.temperature if temperature is None else temperature, top_p=g.top_p,
                          top_k=g.top_k, max_new_tokens=g.max_new_tokens, stop_token_ids=list(g.stop_token_ids),
                          on_update=cfg.rollout.on_update, in_flight=cfg.rollout.in_flight_updates, logprobs=logprobs)
