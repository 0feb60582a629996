"""Reward sources: the env's rule, a reward model handle, or a user's Python function.

Each is a callable ``(prompts, responses, batch) -> (scores [B], metrics)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from xrlhf.algorithms.handles import Handle, Handles
from xrlhf.config.schema import XConfig
from xrlhf.data.batch import Batch
from xrlhf.envs import Env, Prompt
from xrlhf.utils.errors import UserError
from xrlhf.utils.registry import import_path


class SafeReward:
    """Calls a per-batch scorer; when it raises, scores sample by sample to find the culprits.

    Failed samples either stop the run (``fault_tolerance.reward_errors: fail``: a
    ``UserError`` naming the source, the sample and the exception) or score 0 (``zero``);
    either way they are counted in ``reward/errors``.
    """

    def __init__(self, name: str, score_batch: Callable[[list, list[str]], list[float]], on_error: str):
        self.name, self.score_batch, self.on_error = name, score_batch, on_error

    def __call__(self, prompts: list[Prompt], responses: list[str]) -> tuple[list[float], int]:
        try:
            return [float(v) for v in self.score_batch(prompts, responses)], 0
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - a user's code: isolate the failing samples below
            pass
        values, errors = [], 0
        for i, (p, r) in enumerate(zip(prompts, responses)):
            try:
                values.append(float(self.score_batch([p], [r])[0]))
            except Exception as e:  # noqa: BLE001
                if self.on_error == "fail":
                    raise UserError(f"{self.name}: raised {type(e).__name__}: {e} on sample {i} "
                                    f"(prompt {getattr(p, 'text', p)!r}, response {r!r}); fix it or set "
                                    f"fault_tolerance.reward_errors: zero") from None
                values.append(0.0)
                errors += 1
        return values, errors


class EnvReward:
    """Rule rewards from ``env.score``; logs accuracy when the env reports correctness."""

    def __init__(self, env: Env, on_error: str = "fail"):
        self.env = env
        self._correct: list = []
        self.safe = SafeReward(f"env {type(env).__name__}.score", self._score, on_error)

    def _score(self, prompts: list[Prompt], responses: list[str]) -> list[float]:
        scores = self.env.score(prompts, responses)
        self._correct += [s.correct for s in scores]
        return [s.reward for s in scores]

    def __call__(self, prompts: list[Prompt], responses: list[str], batch: Batch):
        self._correct = []
        values, errors = self.safe(prompts, responses)
        metrics = {"reward/errors": float(errors)}
        correct = self._correct[-len(values):]
        if len(correct) == len(values) and all(c is not None for c in correct):
            metrics["reward/accuracy"] = sum(bool(c) for c in correct) / len(correct)
        return torch.tensor(values, dtype=torch.float32), metrics


class ModelReward:
    """Scores from the reward handle (a sequence-score model) on the full prompt+response."""

    def __init__(self, handle: Handle):
        self.handle = handle

    def __call__(self, prompts: list[Prompt], responses: list[str], batch: Batch):
        return self.handle.infer(batch.select("input_ids", "attention_mask", "response_mask"))["scores"], {}


class FunctionReward:
    """A plain function ``fn(prompts: list[str], responses: list[str]) -> list[float]``."""

    def __init__(self, path: str, on_error: str = "fail"):
        try:
            self.fn: Callable = import_path(path)
        except KeyError as e:
            raise UserError(f"reward.function: {e.args[0]}") from None
        self.path = path
        self.safe = SafeReward(f"reward.function {path}", self._score, on_error)

    def _score(self, prompts: list[Prompt], responses: list[str]) -> list[float]:
        values = self.fn([p.text for p in prompts], responses)
        if len(values) != len(responses):
            raise UserError(f"reward.function: {self.path} returned {len(values)} rewards for "
                            f"{len(responses)} responses")
        return values

    def __call__(self, prompts: list[Prompt], responses: list[str], batch: Batch):
        values, errors = self.safe(prompts, responses)
        return torch.tensor(values, dtype=torch.float32), {"reward/errors": float(errors)}


def build_reward(cfg: XConfig, env: Env, handles: Handles) -> Callable:
    """The reward source ``cfg.reward.source`` names: the reward handle, a function or the env's rule."""
    on_error = cfg.fault_tolerance.reward_errors
    if cfg.reward.source == "model":
        return ModelReward(handles.reward)
    if cfg.reward.source == "function":
        return FunctionReward(cfg.reward.function, on_error)
    return EnvReward(env, on_error)
