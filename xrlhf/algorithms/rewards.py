"""Reward sources: the env's rule, a reward model handle, or a user's Python function.

Each is a callable ``(prompts, responses, batch) -> (scores [B], metrics)``.

A reward function is ``fn(prompts, responses)`` or, to see each prompt's reference answer
(``Prompt.answer``: a dataset's ``answer`` column, the reasoning env's right answer),
``fn(prompts, responses, answers)``; which one is read from its signature. It returns one
number per response (``int``, ``float``, a numpy or 0-d torch number; not a string).
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable

import torch
from loguru import logger

from xrlhf.engines.handles import Handle, Handles
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
            raw = self.score_batch(prompts, responses)
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - a user's code: isolate the failing samples below
            pass
        else:
            values = self._numbers(raw, prompts, responses)
            self._warn_non_finite(values, prompts, responses)
            return values, 0
        values, errors, first = [], 0, ""
        for i, (p, r) in enumerate(zip(prompts, responses)):
            try:
                raw = self.score_batch([p], [r])
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001
                where = f"sample {i} (prompt {getattr(p, 'text', p)!r}, response {r!r})"
                if self.on_error == "fail":
                    raise UserError(f"{self.name}: raised {type(e).__name__}: {e} on {where}; fix it or set "
                                    f"fault_tolerance.reward_errors: zero") from None
                first = first or f"{type(e).__name__}: {e} on {where}"
                values.append(0.0)
                errors += 1
                continue
            values += self._numbers(raw, [p], [r], offset=i)
        if errors:
            logger.warning(f"{self.name}: raised on {errors} of {len(responses)} samples, scored 0 "
                           f"(fault_tolerance.reward_errors: zero); first: {first}")
        self._warn_non_finite(values, prompts, responses)
        return values, errors

    def _numbers(self, raw: Any, prompts: list, responses: list[str], offset: int = 0) -> list[float]:
        """``raw`` as floats: a list of numbers, one per response; anything else is a ``UserError``."""
        if hasattr(raw, "tolist") and not isinstance(raw, (str, bytes)):
            raw = raw.tolist()  # a numpy array or a torch tensor
        if isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__len__"):
            raise UserError(f"{self.name}: returned {_short(raw)} (a {type(raw).__name__}); a reward source "
                            f"returns a list with one number per response")
        if len(raw) != len(responses):
            raise UserError(f"{self.name}: returned {len(raw)} rewards for {len(responses)} responses")
        out = []
        for i, v in enumerate(raw):
            if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
                v = v.item()
            if isinstance(v, (str, bytes)) or not isinstance(v, numbers.Real):
                p = prompts[i]
                raise UserError(f"{self.name}: returned {_short(v)} (a {type(v).__name__}) for sample {offset + i} "
                                f"(prompt {getattr(p, 'text', p)!r}, response {responses[i]!r}); a reward is a "
                                f"number")
            out.append(float(v))
        return out

    def _warn_non_finite(self, values: list[float], prompts: list, responses: list[str]) -> None:
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            i = bad[0]
            logger.warning(f"{self.name}: {len(bad)} of {len(values)} rewards are not finite; first: {values[i]} "
                           f"for sample {i} (prompt {getattr(prompts[i], 'text', prompts[i])!r}, response "
                           f"{responses[i]!r})")


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


def load_reward_function(path: str) -> tuple[Callable, bool]:
    """The function at import path ``path`` and whether it takes ``answers``.

    Raises:
        UserError: ``reward.function: ...`` if it cannot be imported, is not callable, or
            cannot be called as ``fn(prompts, responses)`` / ``fn(prompts, responses, answers)``.
    """
    try:
        fn = import_path(path)
    except KeyError as e:
        raise UserError(f"reward.function: {e.args[0]}") from None
    if not callable(fn):
        raise UserError(f"reward.function: {path} is a {type(fn).__name__}, not a function; a reward function "
                        f"is fn(prompts, responses) or fn(prompts, responses, answers) -> list[float]")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn, False  # a builtin without a signature: called with two arguments
    params = sig.parameters
    answers = "answers" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    try:
        sig.bind([], [], **({"answers": []} if answers else {}))
    except TypeError as e:
        raise UserError(f"reward.function: {path}{sig} cannot be called as fn(prompts, responses) or "
                        f"fn(prompts, responses, answers) ({e})") from None
    return fn, answers


class FunctionReward:
    """A plain function ``fn(prompts: list[str], responses: list[str][, answers: list[str | None]]) -> list[float]``."""

    def __init__(self, path: str, on_error: str = "fail"):
        self.fn, self.takes_answers = load_reward_function(path)
        self.path = path
        self.safe = SafeReward(f"reward.function {path}", self._score, on_error)

    def _score(self, prompts: list[Prompt], responses: list[str]) -> Any:
        texts = [p.text for p in prompts]
        if self.takes_answers:
            return self.fn(texts, responses, answers=[p.answer for p in prompts])
        return self.fn(texts, responses)

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


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
