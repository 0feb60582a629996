"""What a trainer receives besides its options: the ``RunSpec`` and its ``TrainerParts``
(``algorithms/build.py`` makes both from the config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from xrlhf.algorithms.rollout import Producer
from xrlhf.algorithms.rollout.evaluate import evaluate, evaluate_episodes
from xrlhf.engines.handles import Handle
from xrlhf.envs import Env
from xrlhf.utils.flops import StepThroughput


@dataclass(frozen=True)
class RunSpec:
    """What a trainer reads of the run beyond its own options.

    Args:
        seed: the run's seed (the trainer's generator, data orders, evaluations).
        steps: ``trainer.steps``; eval_every: ``trainer.eval_every`` (0: none between).
        max_bad_steps: ``fault_tolerance.max_bad_steps``.
        memory_timeline: ``logging.memory_timeline``, its default resolved.
        policy_dropout: ``policy.train.dropout`` (an on-policy step cannot reuse its forward with it).
        algorithm: the name the algorithm was chosen by (a critic-free trainer's default estimator).
        teacher_evaluates: ``teacher.evaluate`` (distill: evaluate the teacher once).
    """

    seed: int
    steps: int
    eval_every: int
    max_bad_steps: int
    memory_timeline: bool
    policy_dropout: float
    algorithm: str
    teacher_evaluates: bool = False


class Evaluator:
    """A generator's answers to the env's held-out prompts, scored (``rollout.evaluate``): one-turn
    samples, or an episode env's episodes on the handle's runner."""

    def __init__(self, params: Callable[[], Any], size: int, seed: int, env: Env, tokenizer, reward,
                 runner_for: Callable[[Handle], Any] | None):
        self.params, self.size, self.seed, self.env, self.tok = params, size, seed, env, tokenizer
        self.reward, self.runner_for = reward, runner_for

    def evaluate(self, handle: Handle, runner=None, keep: Callable | None = None) -> dict[str, float]:
        """``eval/*`` of ``handle``'s answers; ``runner``: its episode runner (an episode env;
        ``keep`` then receives the transcripts)."""
        params = self.params()
        if runner is not None:
            return evaluate_episodes(runner, params, self.size, self.seed, keep=keep)
        reward = self.reward if self.env.reward_source == "model" else None
        return evaluate(handle, self.env, self.tok, params, self.size, reward=reward, seed=self.seed)


@dataclass
class TrainerParts:
    """What ``build_trainer`` makes from the config for every trainer.

    ``collector(keep, timeline, runner)`` and ``producer(collector, state, on_idle)`` build the
    rollout (``None`` for an algorithm that does not generate)."""

    throughput: StepThroughput
    evaluator: Evaluator
    collector: Callable[..., Any] | None = None
    producer: Callable[..., Producer] | None = None
