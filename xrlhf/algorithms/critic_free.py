"""Critic-free policy gradient: GRPO, Dr. GRPO, RLOO, REINFORCE++ (and -baseline), or yours.

These differ from PPO only in where the advantage comes from: instead of a learned critic and
GAE, an estimator turns the scores of ``n`` samples per prompt into per-token advantages
(``xrlhf.algorithms.estimators``). Everything else, the clipped policy loss, the KL to the
reference, mini-batch epochs, is PPO's machinery (``PolicyGradient``). One update::

    old logprobs, reference logprobs  <- policy, reference (in parallel)
    advantages = estimator(scores, response_mask, group_ids [, token rewards with the KL])
    for epoch in ppo_epochs: for mini-batch: clipped policy step (+ k3 KL loss term)

The estimator is ``algorithm.advantage_estimator``: a registered name or an import path
``pkg.mod:fn``. The algorithm names ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp`` and
``reinforce_pp_baseline`` all register this ``Algorithm`` and default the estimator to their own name;
``critic_free`` runs it with the estimator given explicitly. Register your own with
``@ADVANTAGE_ESTIMATORS.register("name")`` (signature in the estimators module).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from xrlhf.algorithms.advantage import GroupEstimator
from xrlhf.algorithms.base import register_algorithm
from xrlhf.algorithms.estimators import ADVANTAGE_ESTIMATORS
from xrlhf.algorithms.policy_gradient import PolicyGradient, advantage_step
from xrlhf.algorithms.ppo import (PolicyGradientConfig, policy_gradient_errors, policy_gradient_steps,
                                  reads_rollout_logprobs)
from xrlhf.algorithms.spec import Algorithm
from xrlhf.config.schema import XConfig

GROUP_ESTIMATORS = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}
"""Built-in estimators that compare the samples of one prompt: they need n >= 2 per prompt."""

OUTCOME_ONLY = {"grpo", "dr_grpo", "rloo"}
"""Built-in estimators that ignore per-token rewards: a KL penalty must go in the loss."""


class CriticFreeConfig(PolicyGradientConfig):
    """``algorithm:`` section of the critic-free trainers (PPO's options plus the estimator)."""

    name: str = "grpo"
    advantage_estimator: str | None = Field(None, description="registered name or 'pkg.mod:fn'; "
                                                              "default: the algorithm's name")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of the REINFORCE++ returns")
    kl_coef: float = Field(0.0, ge=0, description="KL to the reference (0: no reference needed)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="per-token KL estimator of d = log pi_ref - log pi: k1 -d, k2 d^2/2 (both unclamped), "
        "k3 exp(d)-d-1 with d clamped to [-20, 20] (verl/OpenRLHF clamp the estimate itself to +-10)")
    kl_in_reward: bool = Field(False, description="KL as a per-token reward (REINFORCE++) or a loss term (GRPO)")
    whiten_advantages: bool = Field(False, description="whiten the estimator's advantages over the batch")


def estimator_name(o: CriticFreeConfig, algorithm: str) -> str:
    """The estimator chosen: ``advantage_estimator``, else the algorithm's own name (``algorithm.name``)."""
    return o.advantage_estimator or algorithm


def estimator_errors(cfg: XConfig, o: CriticFreeConfig) -> list[str]:
    """The advantage estimator against the rest of the config (each line: the path and the fix)."""
    errors: list[str] = []
    name = estimator_name(o, cfg.algorithm.name)
    try:
        fn = ADVANTAGE_ESTIMATORS.get(name)
    except KeyError as e:
        hint = " (algorithm critic_free needs one)" if o.advantage_estimator is None else ""
        return errors + [f"algorithm.advantage_estimator: {e.args[0]}{hint}"]
    if not callable(fn):
        errors.append(f"algorithm.advantage_estimator: {name!r} is a {type(fn).__name__}, not a function")
    if name in GROUP_ESTIMATORS and cfg.trainer.samples_per_prompt < 2:
        errors.append(f"trainer.samples_per_prompt: estimator {name!r} compares the samples of a prompt "
                      f"and needs at least 2, got {cfg.trainer.samples_per_prompt}")
    if name in OUTCOME_ONLY and o.kl_in_reward and o.kl_coef > 0:
        errors.append(f"algorithm.kl_in_reward: estimator {name!r} uses outcome scores only, so a KL "
                      f"reward would be ignored; set algorithm.kl_in_reward: false (KL as a loss term)")
    return errors


def group_estimator(o: CriticFreeConfig, algorithm: str) -> GroupEstimator:
    """The ``GroupEstimator`` part of options ``o`` under algorithm name ``algorithm``."""
    return GroupEstimator(estimator_name(o, algorithm), o.gamma, o.kl_in_reward, o.whiten_advantages)


def critic_free_errors(cfg: XConfig, o: CriticFreeConfig) -> list[str]:
    """The policy-gradient checks and the estimator's."""
    return policy_gradient_errors(cfg, o) + estimator_errors(cfg, o)


def critic_free_parts(o: CriticFreeConfig, loop) -> PolicyGradient:
    """Policy gradient with advantages from a registered estimator (a ``GroupEstimator``); no critic."""
    return PolicyGradient(loop, o, group_estimator(o, loop.run.algorithm), advantage_step)


CRITIC_FREE = Algorithm(CriticFreeConfig, critic_free_parts, checks=critic_free_errors, steps=policy_gradient_steps,
                        behaviour_logprobs=reads_rollout_logprobs, learns_off_policy=True)
"""The critic-free estimators; each name defaults the estimator to itself (``RunSpec.algorithm``)."""
for _name in ("critic_free", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
    register_algorithm(_name)(CRITIC_FREE)
