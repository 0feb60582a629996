"""Reward sources: the env's rule, a reward model handle, or a user's Python function.

Each is a callable ``(prompts, responses, batch) -> (scores [B], metrics)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from xrlhf.config.schema import XConfig
from xrlhf.data.batch import Batch
from xrlhf.envs import Env, Prompt
from xrlhf.utils.errors import UserError
from xrlhf.utils.registry import import_path


class EnvReward:
    """Rule rewards from ``env.score``; logs accuracy when the env reports correctness."""

    def __init__(self, env: Env):
        self.env = env

    def __call__(self, prompts: list[Prompt], responses: list[str], batch: Batch):
        scores = self.env.score(prompts, responses)
        metrics = {}
        if all(s.correct is not None for s in scores):
            metrics["reward/accuracy"] = sum(bool(s.correct) for s in scores) / len(scores)
        return torch.tensor([s.reward for s in scores], dtype=torch.float32), metrics


class ModelReward:
    """Scores from the reward handle (a sequence-score model) on the full prompt+response."""

    def __init__(self, handle):
        self.handle = handle

    def __call__(self, prompts: list[Prompt], responses: list[str], batch: Batch):
        batch = batch.select("input_ids", "attention_mask", "response_mask")
        n, ranks = len(batch), self.handle.world_size
        if n % ranks:  # the reward model's data-parallel ranks need equal shares: pad, then drop
            batch = Batch.cat([batch, batch.index(torch.arange(ranks - n % ranks) % n)])
        return self.handle.infer(batch)["scores"][:n], {}


class FunctionReward:
    """A plain function ``fn(prompts: list[str], responses: list[str]) -> list[float]``."""

    def __init__(self, path: str):
        try:
            self.fn: Callable = import_path(path)
        except KeyError as e:
            raise UserError(f"reward.function: {e.args[0]}") from None
        self.path = path

    def __call__(self, prompts: list[Prompt], responses: list[str], batch: Batch):
        values = self.fn([p.text for p in prompts], responses)
        if len(values) != len(responses):
            raise UserError(f"reward.function: {self.path} returned {len(values)} rewards for "
                            f"{len(responses)} responses")
        return torch.tensor([float(v) for v in values], dtype=torch.float32), {}


def build_reward(cfg: XConfig, env: Env, handles) -> Callable:
    if cfg.reward.source == "model":
        return ModelReward(handles["reward"])
    if cfg.reward.source == "function":
        return FunctionReward(cfg.reward.function)
    return EnvReward(env)
