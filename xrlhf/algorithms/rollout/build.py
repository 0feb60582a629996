"""The rollout path of a run, from its config: sampler, refill policy, collector, producer.

The only place that reads the ``rollout`` and ``trainer`` sections for the rollout; the pieces
it builds take plain values.
"""

from __future__ import annotations

from typing import Callable

from xrlhf.algorithms.rollout.collector import Collector
from xrlhf.algorithms.rollout.episodes import EpisodeRunner, Episodes
from xrlhf.algorithms.rollout.producer import Producer
from xrlhf.algorithms.rollout.refill import GroupFilter, build_refill
from xrlhf.algorithms.rollout.single_turn import SingleTurn
from xrlhf.algorithms.rollout.types import Reward, Sampling, sampling_params
from xrlhf.config.schema import XConfig
from xrlhf.envs import Env
from xrlhf.envs.episode import is_episode_env
from xrlhf.utils.timeline import Timeline


def streamed(cfg: XConfig) -> bool:
    """``rollout.stream_rewards`` resolved: on with ``max_staleness > 0`` unless set."""
    r = cfg.rollout
    return r.stream_rewards if r.stream_rewards is not None else r.max_staleness > 0


def rollout_sampling(cfg: XConfig, logprobs: bool = True) -> Sampling:
    """How the run's batches are sampled (``logprobs``: the algorithm reads the sampler's)."""
    from xrlhf.engines.base import engine_class

    free = engine_class(cfg.policy.generate.engine, "generate").logprobs_are_free  # for the mismatch metric
    return Sampling(n=cfg.trainer.samples_per_prompt, params=sampling_params(cfg, logprobs=logprobs or free),
                    seed=cfg.seed, parts=cfg.rollout.stream_parts if streamed(cfg) else 1, model=cfg.policy.model)


def continuous(cfg: XConfig) -> bool:
    """Whether the generate engine serves concurrent calls together (continuous batching)."""
    from xrlhf.engines.base import engine_class

    return bool(getattr(engine_class(cfg.policy.generate.engine, "generate"), "batches_concurrent_calls", False))


def episode_runner(cfg: XConfig, env: Env, tokenizer, generator) -> EpisodeRunner:
    """The runner of ``env``'s episodes on ``generator``: one call per episode turn when the
    generate engine serves concurrent calls together (continuous batching), else waves."""
    return EpisodeRunner(env, tokenizer, generator, continuous=continuous(cfg) and hasattr(generator, "generate_on"),
                         ranks=generator.world_size)


def episode_calls(cfg: XConfig, env: Env) -> int:
    """How many ``generate`` calls an episode env may have running at once on one generator
    (one per episode of a batch, and of an evaluation beside it); 0 for a one-turn env or waves."""
    if not is_episode_env(env) or not continuous(cfg):
        return 0
    t = cfg.trainer
    evals = t.eval_size or len(env.eval_prompts())
    return min(4096, t.prompts_per_step * t.samples_per_prompt + evals)


def build_collector(cfg: XConfig, env: Env, tokenizer, generator, reward: Reward, keep: GroupFilter,
                    timeline: Timeline, runner: EpisodeRunner | None = None, logprobs: bool = True) -> Collector:
    """The run's collector: episodes or one-turn samples, with the ``rollout.refill`` policy;
    ``logprobs``: the algorithm reads the sampler's logprobs (``Algorithm.reads_behaviour_logprobs``)."""
    sampling = rollout_sampling(cfg, logprobs)
    if is_episode_env(env):
        runner = runner or episode_runner(cfg, env, tokenizer, generator)
        sampler = Episodes(sampling, runner, reward, cfg.reward.source == "env", timeline)
    else:
        sampler = SingleTurn(sampling, tokenizer, generator, reward, timeline)
    return Collector(env, sampler, build_refill(cfg.rollout.refill.model_dump(), cfg.trainer.prompts_per_step, keep))


def build_producer(cfg: XConfig, collector: Collector, state: dict, on_idle: Callable[[], float]) -> Producer:
    """The run's producer, from ``state``'s ``next`` batch, ``data_pos``, restored ``queue`` and
    the version ``synced``."""
    return Producer(collector, cfg.rollout, cfg.trainer.steps, state["next"], state["data_pos"],
                    synced=state["synced"], queue=state["queue"], on_idle=on_idle)
