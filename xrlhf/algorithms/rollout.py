"""Rollouts: one step's scored samples, and how a batch of them is collected.

``Rollout`` is what a trainer's ``update`` receives. ``RolloutCollector`` builds one batch the
way the asynchronous producer (``algorithms/producer.py``) and the synchronous loop with
streaming or dynamic sampling need it:

* every sample is drawn from its own seed (``producer.sample_seed(run seed, batch, row,
  round)``), so a batch is a function of its index, data position and the weights, whatever
  the timing or the split over generators (exact resume regenerates it);
* **streaming rewards**: the batch is generated in ``rollout.stream_parts`` parts, all sent at
  once (a vLLM generator batches them together, see ``GenerateEngine.generate``), and each part
  is scored as soon as it comes back, while later parts still generate;
* **dynamic sampling** (DAPO, Yu et al. 2025): groups for which the algorithm's
  ``group_filter`` says no (all rewards equal: no group-relative signal) are dropped and the
  next prompts generated until ``trainer.prompts_per_step`` groups are kept, or
  ``max_generated_factor`` times that many were generated; then the batch is filled with the
  last dropped groups (counted: ``sampling/filled_groups``).

The synchronous loop without either feature keeps ``RLTrainer.rollout`` (one generate call, the
engine's own random stream): its numbers are unchanged.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from xrlhf.algorithms.episodes import EpisodeRunner, Trajectory, episode_batch, episode_metrics
from xrlhf.algorithms.producer import sample_seed
from xrlhf.config.schema import XConfig
from xrlhf.data.batch import Batch, build_sequences
from xrlhf.data.lengths import check_prompt_lengths
from xrlhf.data.text import decode_responses, encode_prompt
from xrlhf.engines.base import SamplingParams
from xrlhf.envs import Env, Prompt
from xrlhf.utils.timeline import Timeline


@dataclass
class Rollout:
    """One step's samples: the ``Batch`` (layout of ``xrlhf.data.batch``) and their texts.

    ``batch`` holds ``input_ids``, ``attention_mask``, ``response_mask``, ``rollout_logprobs``,
    ``scores`` ``[B]`` and ``group_ids`` ``[B]`` (the prompt each sample came from); collected
    by ``RolloutCollector`` also ``token_versions`` ``[B, R]`` (the policy version that sampled
    each response token, 0 on padding).
    """

    batch: Batch
    prompts: list[Prompt]
    responses: list[str]
    metrics: dict[str, float] = field(default_factory=dict)


def sampling_params(cfg: XConfig, temperature: float | None = None) -> SamplingParams:
    g = cfg.policy.generate
    return SamplingParams(temperature=g.temperature if temperature is None else temperature, top_p=g.top_p,
                          top_k=g.top_k, max_new_tokens=g.max_new_tokens, stop_token_ids=list(g.stop_token_ids),
                          on_update=cfg.rollout.on_update, in_flight=cfg.rollout.in_flight_updates)


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
    trajs: list[Trajectory] | None = None


Reward = Callable[[list[Prompt], list[str], Batch], tuple[torch.Tensor, dict]]


class RolloutCollector:
    """Collects batch ``b`` from data position ``pos`` (see the module docstring).

    Args:
        cfg: the run's config (``trainer``, ``rollout``, ``policy.generate``, ``seed``).
        env, tokenizer: the environment and the policy's tokenizer.
        generator: the handle that samples (``Handles.generator``).
        reward: ``(prompts, responses, batch) -> (scores [B], metrics)``.
        group_filter: ``scores [n] -> keep?`` for dynamic sampling.
        episodes: runs an episode env's samples (``algorithms.episodes``); ``None`` for a
            single-turn env.
    """

    def __init__(self, cfg: XConfig, env: Env, tokenizer, generator, reward: Reward,
                 group_filter: Callable[[torch.Tensor], bool], timeline: Timeline | None = None,
                 episodes: EpisodeRunner | None = None):
        self.cfg, self.env, self.tok, self.generator = cfg, env, tokenizer, generator
        self.reward, self.group_filter = reward, group_filter
        self.timeline = timeline or Timeline()
        self.episodes = episodes

    def __call__(self, b: int, pos: int, on_generated: Callable[[], None]) -> tuple[Rollout, int]:
        t, ds = self.cfg.trainer, self.cfg.rollout.dynamic_sampling
        need = t.prompts_per_step
        cap = max(need, math.floor(ds.max_generated_factor * need)) if ds.enabled else need
        kept: list[Group] = []
        dropped: list[Group] = []
        stats = {"time/generate_s": 0.0, "time/reward_s": 0.0, "tokens": 0.0}
        rmetrics: dict[str, float] = {}
        generated, attempt = 0, 0
        while len(kept) < need and generated < cap:
            m = min(need - len(kept), cap - generated)
            for g in self.generate_groups(self.env.train_prompts(pos, m), b, attempt, stats, rmetrics):
                (kept if not ds.enabled or self.group_filter(g.scores) else dropped).append(g)
            pos, generated, attempt = pos + m, generated + m, attempt + 1
        on_generated()
        filled = need - len(kept)
        kept += dropped[len(dropped) - filled:] if filled else []
        rollout = self.assemble(kept, stats, {k: v / generated for k, v in rmetrics.items()})
        if ds.enabled:
            rollout.metrics.update({"sampling/generated_groups": float(generated),
                                    "sampling/kept_fraction": (need - filled) / generated,
                                    "sampling/overgeneration": generated / need,
                                    "sampling/filled_groups": float(filled)})
        return rollout, pos

    def generate_groups(self, prompts: list[Prompt], b: int, attempt: int, stats: dict[str, float],
                        rmetrics: dict[str, float]) -> list[Group]:
        """``n`` samples of each prompt, generated in parts that are scored as they arrive."""
        if self.episodes is not None:
            return self.episode_groups(prompts, b, attempt, stats, rmetrics)
        n = self.cfg.trainer.samples_per_prompt
        ids = [encode_prompt(self.tok, p.text) for p in prompts]
        check_prompt_lengths([i for i in ids for _ in range(n)], [p.text for p in prompts for _ in range(n)],
                             self.cfg.policy.generate.max_new_tokens, self.cfg.policy.model)
        r = self.cfg.rollout
        streamed = r.stream_rewards is not False
        parts = _cut(len(prompts), r.stream_parts if streamed else 1)
        params = sampling_params(self.cfg)
        t0 = time.time()
        pending = []
        for lo, hi in parts:  # all parts at once: the generator batches them together
            rows = [ids[i] for i in range(lo, hi) for _ in range(n)]
            seeds = [sample_seed(self.cfg.seed, b, row, attempt) for row in range(lo * n, hi * n)]
            pending.append(self.generator.generate(rows, params, seeds, wait=False))
        groups: list[Group] = []
        for i, ((lo, hi), call) in enumerate(zip(parts, pending)):
            out = call.get()
            self.timeline.add("generator", f"b{b}" + (f".{i}" if len(parts) > 1 else ""), t0, time.time())
            stats["time/generate_s"] = time.time() - t0
            with self.timeline.span("reward", f"b{b}"):
                groups += self._score(prompts[lo:hi], ids[lo:hi], out, stats, rmetrics)
        return groups

    def episode_groups(self, prompts: list[Prompt], b: int, attempt: int, stats: dict[str, float],
                       rmetrics: dict[str, float]) -> list[Group]:
        """``n`` episodes of each prompt; each is scored by its env as it ends (its return), or,
        with ``reward.source`` model or function, the whole trajectory by that source."""
        n = self.cfg.trainer.samples_per_prompt
        expanded = [p for p in prompts for _ in range(n)]
        seeds = [sample_seed(self.cfg.seed, b, row, attempt) for row in range(len(expanded))]
        t0 = time.time()
        with self.timeline.span("generator", f"b{b}"):
            trajs = self.episodes.run(expanded, seeds, sampling_params(self.cfg))
        stats["time/generate_s"] += time.time() - t0
        stats["tokens"] += float(sum(sum(t.loss_mask) for t in trajs))
        texts = [t.actions[-1] if t.actions else "" for t in trajs]
        if self.cfg.reward.source == "env":
            scores = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        else:
            t0 = time.time()
            with self.timeline.span("reward", f"b{b}"):
                scores, metrics = self.reward(expanded, texts, episode_batch(trajs, self.tok.pad_token_id))
            scores = scores.float()
            for k, v in metrics.items():
                rmetrics[k] = rmetrics.get(k, 0.0) + float(v) * len(prompts)
            stats["time/reward_s"] += time.time() - t0
        return [Group(p, trajs[g * n].prompt_ids, [t.tokens for t in trajs[g * n:(g + 1) * n]],
                      [t.logprobs for t in trajs[g * n:(g + 1) * n]], [t.versions for t in trajs[g * n:(g + 1) * n]],
                      texts[g * n:(g + 1) * n], scores[g * n:(g + 1) * n], trajs[g * n:(g + 1) * n])
                for g, p in enumerate(prompts)]

    def _score(self, prompts: list[Prompt], ids: list[list[int]], out, stats: dict[str, float],
               rmetrics: dict[str, float]) -> list[Group]:
        n = self.cfg.trainer.samples_per_prompt
        t0 = time.time()
        expanded = [p for p in prompts for _ in range(n)]
        rows = [i for i in ids for _ in range(n)]
        batch = build_sequences(rows, out.token_ids, self.tok.pad_token_id, out.logprobs)
        texts = decode_responses(self.tok, out.token_ids)
        scores, metrics = self.reward(expanded, texts, batch)
        scores = scores.float()
        for k, v in metrics.items():  # means over the part, weighted by its prompts below
            rmetrics[k] = rmetrics.get(k, 0.0) + float(v) * len(prompts)
        stats["time/reward_s"] += time.time() - t0
        stats["tokens"] += float(sum(len(t) for t in out.token_ids))
        versions = out.versions or [[0] * len(t) for t in out.token_ids]
        return [Group(p, i, out.token_ids[g * n:(g + 1) * n], out.logprobs[g * n:(g + 1) * n],
                      versions[g * n:(g + 1) * n], texts[g * n:(g + 1) * n], scores[g * n:(g + 1) * n])
                for g, (p, i) in enumerate(zip(prompts, ids))]

    def assemble(self, groups: list[Group], stats: dict[str, float], rmetrics: dict[str, float]) -> Rollout:
        """One ``Rollout`` of the groups, in order (``group_ids`` 0 .. len(groups) - 1)."""
        n = self.cfg.trainer.samples_per_prompt
        prompts = [g.prompt for g in groups for _ in range(n)]
        if self.episodes is not None:
            trajs = [t for g in groups for t in g.trajs]
            batch = episode_batch(trajs, self.tok.pad_token_id, self.env.config.mask_truncated)
            if self.cfg.reward.source != "env":  # the reward source scored whole trajectories
                del batch.tensors["turn_rewards"]
            rmetrics = {**rmetrics, **episode_metrics(trajs)}
        else:
            rows = [g.prompt_ids for g in groups for _ in range(n)]
            tokens = [t for g in groups for t in g.tokens]
            batch = build_sequences(rows, tokens, self.tok.pad_token_id, [lp for g in groups for lp in g.logprobs])
            versions = torch.zeros(batch["response_mask"].shape, dtype=torch.long)
            for i, v in enumerate(v for g in groups for v in g.versions):
                versions[i, :len(v)] = torch.tensor(v, dtype=torch.long)
            batch["token_versions"] = versions
        scores = torch.cat([g.scores for g in groups])
        batch["scores"] = scores
        batch["group_ids"] = torch.arange(len(groups)).repeat_interleave(n)
        n_tokens = float(batch["response_mask"].sum())
        metrics = {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                   "response/length_mean": n_tokens / len(batch),
                   "perf/gen_tokens_per_s": stats["tokens"] / max(stats["time/generate_s"], 1e-9),
                   "time/generate_s": stats["time/generate_s"], "time/reward_s": stats["time/reward_s"], **rmetrics}
        return Rollout(batch, prompts, [t for g in groups for t in g.texts], metrics)


def _cut(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` in ``min(parts, n)`` consecutive ranges of near-equal size."""
    parts = max(1, min(parts, n))
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
