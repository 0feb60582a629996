"""On-policy distillation: the student (the policy) samples, a teacher scores every token it wrote.

Why: a sparse task reward says once per answer whether it was right; a teacher's logprob of
each sampled token says at every token how far the student is from the teacher, so the student
reaches the teacher's level in a fraction of the samples RL needs (Qwen3's small models, the
on-policy distillation recipes of verl, slime, Thinking Machines; GKD, Agarwal et al. 2024). One
update, as the GRPO family's with another advantage::

    teacher logprobs  <- teacher.infer(the student's tokens)       (the teacher handle)
    old logprobs      <- policy.infer                              (the student, before the update)
    A_t = -c_t (+ task_reward_weight * GRPO advantage of the env's reward)
          c_t = log pi(y_t) - log pi_T(y_t) (reverse KL) or the JSD's cost (algorithms.divergence)
    for epoch in ppo_epochs: for mini-batch: clipped policy step, off-policy correction as GRPO's

Environment tokens of an episode have ``response_mask`` 0, so only the student's own tokens are
scored and trained. ``offline_dataset`` mixes a fraction of teacher completions into each batch
(GKD's mixed on/off-policy data): those rows are trained by the forward KL of the teacher's
sampled tokens, whose gradient is their NLL (advantage +1 per token at ratio 1). The teacher is
one more frozen handle (``teacher`` section: its own model, engine, resources), restarted in
place like the reference; with ``teacher.evaluate`` it is evaluated greedily once, and every
evaluation row carries its reward beside the student's (``eval/teacher_reward_mean``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from xrlhf.algorithms import divergence as D
from xrlhf.algorithms.advantage import DistillAdvantage
from xrlhf.algorithms.functional import masked_mean
from xrlhf.algorithms.base import Rollout, register_algorithm
from xrlhf.algorithms.critic_free import CriticFreeConfig, estimator_errors, group_estimator
from xrlhf.algorithms.policy_gradient import PolicyGradient
from xrlhf.algorithms.ppo import policy_gradient_errors, policy_gradient_steps, reads_rollout_logprobs
from xrlhf.algorithms.spec import Algorithm
from xrlhf.algorithms.teacher import OfflineRows, Teacher
from xrlhf.config.schema import XConfig
from xrlhf.data.datasets import COMPLETIONS, DatasetPath
from xrlhf.envs.episode import is_episode_env


class DistillConfig(CriticFreeConfig):
    """``algorithm:`` section of ``distill`` (the GRPO family's options, plus these)."""

    name: str = "distill"
    divergence: Literal["reverse_kl", "jsd"] = Field(
        "reverse_kl", description="per-token divergence to the teacher: reverse_kl KL(student || teacher), or jsd "
        "GKD's generalized JSD(jsd_beta); both from the sampled tokens' logprobs (docs/design/distill-divergence.md)")
    jsd_beta: float = Field(0.5, gt=0, lt=1, description="jsd: the teacher's weight in the mixture (0.5: symmetric)")
    task_reward_weight: float = Field(0.0, ge=0, description="add this times the env reward's advantage (from "
                                      "advantage_estimator, default grpo) to every token's distillation advantage")
    advantage_estimator: str | None = Field("grpo", description="the task reward's estimator")
    offline_dataset: DatasetPath | None = Field(None, description="teacher completions {prompt, completion} (JSONL "
                                                "/ parquet) mixed into every batch (GKD's off-policy data)")
    offline_fraction: float = Field(0.0, ge=0, lt=1, description="the share of each update's rows taken from "
                                    "offline_dataset (the rollout keeps its size; these rows are added)")
    topk_coef: float = Field(0.0, ge=0, description="add this times the top-k reverse KL to the teacher (over the "
                             "teacher's k most likely tokens and a tail bucket; differentiated directly, not "
                             "sampled) to the loss of every token; needs teacher.infer.topk_logprobs: k")


def teacher_errors(cfg: XConfig) -> list[str]:
    """The teacher against the student, read from the two directories before any model loads: the
    same tokenizer (vocabulary and special tokens), and a teacher whose embedding covers it. The
    embedding sizes may differ (Qwen2.5's 0.5B and 7B pad the same tokenizer to 151,936 and
    152,064 rows): only the logprobs of token ids both know are read."""
    from transformers import AutoConfig

    from xrlhf.data.text import load_tokenizer

    if cfg.teacher is None:
        return ["teacher: algorithm distill needs a teacher section (teacher: {model: <an HF model directory with "
                "the policy's tokenizer>})"]
    t, s = cfg.teacher.model, cfg.policy.model
    try:
        tt, st = load_tokenizer(t), load_tokenizer(s)
        rows = AutoConfig.from_pretrained(t).vocab_size
    except Exception as e:  # noqa: BLE001 - one line naming the directory
        return [f"teacher.model: cannot read the tokenizer and config of {t} or {s} ({str(e).splitlines()[0]})"]
    a, b = tt.get_vocab(), st.get_vocab()
    specials = [k for k in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(tt, k) != getattr(st, k)]
    if a != b or specials:
        say = lambda v: "absent" if v is None else f"id {v}"  # noqa: E731
        diff = next((f"token {k!r}: {say(a.get(k))} there, {say(b.get(k))} here" for k in sorted(a.keys() | b.keys())
                     if a.get(k) != b.get(k)), None) or f"{specials[0]} differs"
        return [f"teacher.model: {t} has another tokenizer than policy.model {s} ({len(a)} vs {len(b)} tokens; "
                f"{diff}); the teacher scores the student's token ids, so it needs the student's tokenizer: choose "
                f"a teacher trained with it"]
    if rows < len(b):
        return [f"teacher.model: {t} has {rows} embedding rows (vocab_size in config.json) for a tokenizer of {len(b)} "
                f"tokens; use a teacher whose embedding covers its tokenizer"]
    return []


def distill_errors(cfg: XConfig, o: DistillConfig) -> list[str]:
    """The policy-gradient checks, the distillation options' and the teacher's."""
    errors = policy_gradient_errors(cfg, o)
    if o.task_reward_weight > 0:  # the task reward's estimator, checked only when it is used
        errors += estimator_errors(cfg, o)
    if o.task_reward_weight == 0 and "advantage_estimator" in o.model_fields_set:
        errors.append("algorithm.advantage_estimator: only used with algorithm.task_reward_weight > 0; remove it")
    if "jsd_beta" in o.model_fields_set and o.divergence != "jsd":
        errors.append("algorithm.jsd_beta: only used with algorithm.divergence: jsd; remove it")
    if (o.offline_dataset is None) != (o.offline_fraction == 0):
        errors.append("algorithm.offline_fraction: set offline_dataset and offline_fraction > 0 together (the "
                      "share of each update's rows that are teacher completions)")
    if o.offline_dataset is not None and _episode_env_name(cfg.env.name):
        errors.append("algorithm.offline_dataset: teacher completions are one-turn rows; env "
                      f"{cfg.env.name!r} runs episodes: remove it")
    topk = cfg.teacher.infer.engine_fields().get("topk_logprobs", 0) if cfg.teacher is not None else 0
    if o.topk_coef > 0 and not topk:
        errors.append("algorithm.topk_coef: needs the teacher's top-k tokens: set teacher.infer.topk_logprobs "
                      "(e.g. 32)")
    if topk and o.topk_coef == 0:
        errors.append("teacher.infer.topk_logprobs: only used with algorithm.topk_coef > 0; set it or remove "
                      "topk_logprobs")
    return errors + teacher_errors(cfg)


def distill_parts(o: DistillConfig, loop) -> PolicyGradient:
    """The GRPO family's update with per-token advantages from the teacher's logprobs: a
    ``Teacher``, ``OfflineRows`` (with ``offline_dataset``), a ``DistillAdvantage`` (holding the
    task reward's ``GroupEstimator`` when ``task_reward_weight > 0``) and the loss's ``topk_coef``."""
    rows = OfflineRows(o.offline_dataset, o.offline_fraction, loop.run.seed, loop.tok) if o.offline_dataset else None
    task = group_estimator(o, loop.run.algorithm) if o.task_reward_weight > 0 else None
    advantage = DistillAdvantage(o.divergence, o.jsd_beta, task, o.task_reward_weight, o.whiten_advantages)
    return PolicyGradient(loop, o, advantage, distill_step, teacher=Teacher(loop.handles.teacher, loop.timeline),
                          rows=rows, topk_coef=o.topk_coef)


def distill_step(update: PolicyGradient, rollout: Rollout, n_rollout: int) -> dict[str, float]:
    """The teacher's cost (and the task reward's advantage) as advantages, with ``distill/*`` metrics.
    Rows past ``n_rollout`` are teacher completions: no behaviour weight, +1 per token."""
    batch = rollout.batch
    if n_rollout < len(batch) and "rollout_logprobs" in batch:  # offline rows: no behaviour weight
        batch["rollout_logprobs"][n_rollout:] = batch["old_logprobs"][n_rollout:]
    mask = batch["response_mask"]
    student, teacher = batch["old_logprobs"], batch.tensors.pop("teacher_logprobs")
    on_policy = (torch.arange(len(batch)) < n_rollout).float().unsqueeze(1) * mask
    batch["advantages"] = update.advantage.compute(batch, update.kl_ctl.value, teacher, on_policy)["advantages"]
    metrics = divergence_metrics(update.options, update.loop.env, rollout, student[:n_rollout], teacher[:n_rollout],
                                 mask[:n_rollout])
    metrics["advantages/mean"] = float(masked_mean(batch["advantages"], mask))
    return metrics


DISTILL = register_algorithm("distill")(Algorithm(
    DistillConfig, distill_parts, checks=distill_errors, steps=policy_gradient_steps,
    behaviour_logprobs=reads_rollout_logprobs, uses_teacher=True, learns_off_policy=True, schema=COMPLETIONS,
    progress_keys=(("distill/reverse_kl", "rkl"), ("reward/mean", "reward"), ("policy/loss", "pg_loss"))))
"""On-policy distillation (module docstring)."""


def divergence_metrics(o: DistillConfig, env, rollout: Rollout, student: torch.Tensor, teacher: torch.Tensor,
                       mask: torch.Tensor) -> dict[str, float]:
    """``distill/reverse_kl`` (per token, k1 estimate) and its split by whether the student's
    answer was right (``_right`` / ``_wrong``); ``distill/jsd`` with the JSD."""
    correct = correct_answers(env, rollout, len(mask))
    out = {}
    names = [("reverse_kl", "reverse_kl")] + ([("jsd", "jsd")] if o.divergence == "jsd" else [])
    for name, div in names:
        est = D.divergence_estimate(student, teacher, mask, div, o.jsd_beta)
        if correct is None:
            out[f"distill/{name}"] = float(masked_mean(est, mask))
            continue
        split = D.split_by_correct(est, mask, correct)
        out[f"distill/{name}"] = split.pop("mean")
        out.update({f"distill/{name}_{k}": v for k, v in split.items()})
    return out


def correct_answers(env, rollout: Rollout, n: int) -> torch.Tensor | None:
    """``[n]`` whether each of the rollout's ``n`` samples was right, where the env judges it
    (one-turn envs with rule rewards); ``None`` elsewhere."""
    judged_here = not is_episode_env(env) and env.reward_source == "rule"
    if not judged_here or not len(rollout.prompts) == len(rollout.responses) == n:
        return None
    judged = [s.correct for s in env.score(rollout.prompts, rollout.responses)]
    if any(c is None for c in judged):
        return None
    return torch.tensor(judged)


def _episode_env_name(name: str) -> bool:
    from xrlhf.envs import ENVS

    try:
        return is_episode_env(ENVS.get(name))
    except KeyError:
        return False
