"""Evaluation on the env's held-out prompts: one seeded sample each, scored like the rollout.

Eval samples are keyed like a batch's (``sample_seed(run seed, -1, i)``), so an eval at a
temperature above 0 is a function of the seed and the weights, as a batch is.
"""

from __future__ import annotations

import time
from typing import Callable

from xrlhf.algorithms.rollout.episodes import EpisodeRunner, episode_metrics
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import decode_responses, encode_prompt
from xrlhf.engines.base import SamplingParams
from xrlhf.envs import Env, Prompt, clean_response
from xrlhf.utils.seeds import sample_seed


def evaluate(generator, env: Env, tokenizer, params: SamplingParams, limit: int | None = None,
             reward: Callable | None = None, seed: int = 0) -> dict[str, float]:
    """Mean reward (and accuracy, per task) of ``generator`` (a handle) on the env's held-out prompts.

    ``reward``: score with this reward source ``(prompts, responses, batch) -> (scores, metrics)``
    instead of ``env.score`` (envs whose ``reward_source`` is ``"model"``).
    """
    prompts = env.eval_prompts()[:limit]
    ids = [encode_prompt(tokenizer, p.text) for p in prompts]
    out = generator.generate(ids, params, [sample_seed(seed, -1, i) for i in range(len(ids))])
    texts = decode_responses(tokenizer, out.token_ids)
    if reward is not None:
        return _evaluate_with(reward, prompts, ids, out.token_ids, texts, tokenizer.pad_token_id)
    scores = env.score(prompts, texts)
    metrics = {"eval/reward_mean": sum(s.reward for s in scores) / len(scores)}
    if all(s.correct is not None for s in scores):
        metrics["eval/accuracy"] = sum(bool(s.correct) for s in scores) / len(scores)
    for task in sorted({p.task for p in prompts if p.task}):
        rows = [s.reward for p, s in zip(prompts, scores) if p.task == task]
        metrics[f"eval/reward_{task}"] = sum(rows) / len(rows)
    return metrics


def _evaluate_with(reward: Callable, prompts: list[Prompt], ids: list[list[int]], responses: list[list[int]],
                   texts: list[str], pad_id: int) -> dict[str, float]:
    """Eval metrics from a reward source: mean score, and exact match where prompts have answers."""
    scores, _ = reward(prompts, texts, build_sequences(ids, responses, pad_id))
    metrics = {"eval/reward_mean": float(scores.float().mean())}
    if all(p.answer is not None for p in prompts):
        metrics["eval/exact_match"] = sum(clean_response(t) == p.answer for p, t in zip(prompts, texts)) / len(prompts)
    return metrics


def evaluate_episodes(runner: EpisodeRunner, params: SamplingParams, limit: int | None = None,
                      seed: int = 0, keep: Callable[[list], None] | None = None) -> dict[str, float]:
    """``eval/reward_mean``, ``eval/accuracy`` and the episode metrics (``eval/turns_mean``, ...) of
    the env's held-out prompts, one episode each; ``keep`` is given the trajectories (transcripts)."""
    prompts = runner.env.eval_prompts()[:limit]
    t0 = time.time()
    trajs = runner.run(prompts, [sample_seed(seed, -1, i) for i in range(len(prompts))], params)
    if keep is not None:
        keep(trajs)
    m = {"eval/reward_mean": sum(t.reward for t in trajs) / len(trajs), **episode_metrics(trajs, "eval/")}
    if all(t.correct is not None for t in trajs):
        m["eval/accuracy"] = sum(bool(t.correct) for t in trajs) / len(trajs)
    m["eval/time_s"] = time.time() - t0
    return m
