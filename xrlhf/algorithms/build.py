"""From the run's config to a trainer: the one place that reads ``cfg`` for one.

Why: a trainer receives its own options (``algorithm:``), a small ``RunSpec`` and the parts
built here (the evaluation, the rollout's collector and producer, the throughput meter), so
what a trainer depends on is visible in its arguments (STYLE 19). The validation-time hooks
(``check_config``, ``train_steps``) still take ``cfg``: they name other sections' YAML paths.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from pydantic import BaseModel

from xrlhf.algorithms.base import ALGORITHMS, RLTrainer
from xrlhf.algorithms.rollout import sampling_params
from xrlhf.algorithms.rollout.build import build_collector, build_producer, episode_runner
from xrlhf.algorithms.run import Evaluator, RunSpec, TrainerParts
from xrlhf.config.schema import XConfig
from xrlhf.data.batch import Batch
from xrlhf.engines.handles import Handles
from xrlhf.envs import Env, Prompt
from xrlhf.envs.episode import is_episode_env
from xrlhf.utils.flops import MatmulShape, StepThroughput
from xrlhf.utils.run_hooks import RunHooks


def run_spec(cfg: XConfig) -> RunSpec:
    """The ``RunSpec`` of ``cfg``."""
    t = cfg.trainer
    return RunSpec(seed=cfg.seed, steps=t.steps, eval_every=t.eval_every,
                   max_bad_steps=cfg.fault_tolerance.max_bad_steps, memory_timeline=memory_timeline_on(cfg),
                   policy_dropout=cfg.policy.train.dropout, algorithm=cfg.algorithm.name,
                   teacher_evaluates=bool(cfg.teacher is not None and cfg.teacher.evaluate))


def build_trainer(cfg: XConfig, options: BaseModel, handles: Handles, env: Env, tokenizer,
                  reward: Callable[[list[Prompt], list[str], Batch], tuple[torch.Tensor, dict]] | None,
                  hooks: RunHooks, algorithm: Any = None):
    """The trainer of ``cfg.algorithm.name`` (or of ``algorithm``, an ``Algorithm``): its loop
    with its options, run spec and parts."""
    spec = algorithm or ALGORITHMS.get(cfg.algorithm.name)
    t = cfg.trainer
    runner_for = partial(episode_runner, cfg, env, tokenizer) if is_episode_env(env) else None
    evaluator = Evaluator(partial(sampling_params, cfg, t.eval_temperature, logprobs=False), t.eval_size, cfg.seed,
                          env, tokenizer, reward, runner_for)
    parts = TrainerParts(StepThroughput(_matmul_shape(cfg.policy.model), getattr(cfg.algorithm, "ppo_epochs", 1)),
                         evaluator)
    if not issubclass(spec.loop, RLTrainer):  # an offline loop: a dataset, no rollout
        return spec.loop(run_spec(cfg), options, parts, handles, env, tokenizer, reward=reward, hooks=hooks,
                         algorithm=spec)
    logprobs = spec.reads_behaviour_logprobs(cfg, options)  # an online algorithm: the rollout's parts
    parts.collector = lambda generator, keep, timeline, runner: build_collector(
        cfg, env, tokenizer, generator, reward, keep, timeline, runner, logprobs=logprobs)
    parts.producer = partial(build_producer, cfg)
    return spec.loop(run_spec(cfg), options, parts, handles, env, tokenizer, reward=reward, hooks=hooks,
                     algorithm=spec)


def _matmul_shape(model: str) -> MatmulShape | None:
    """The policy's ``MatmulShape`` for MFU; ``None`` where its ``config.json`` is not Llama-like."""
    try:
        return MatmulShape.of_model(model)
    except (OSError, KeyError, TypeError, ValueError):
        return None


def memory_timeline_on(cfg: XConfig) -> bool:
    """``logging.memory_timeline``, its default resolved: on when a handle of the run has a GPU."""
    if cfg.logging.memory_timeline is not None:
        return cfg.logging.memory_timeline
    sections = [cfg.policy, cfg.policy.generate, cfg.critic, cfg.reference, cfg.reward, cfg.teacher]
    return any(getattr(getattr(s, "resources", None), "gpus_per_rank", 0) > 0 for s in sections if s is not None)
