"""PPO with a critic and GAE (Schulman et al. 2017; Ouyang et al. 2022 for the RLHF form).

One update, as in the paper's pseudocode::

    old logprobs, reference logprobs, values  <- policy, reference, critic (in parallel)
    token rewards = score on the last token - kl_coef * KL(policy || reference)
    advantages, returns = GAE(token rewards, values); whiten advantages
    for epoch in ppo_epochs: for mini-batch: policy step (clipped), critic step (clipped)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from xrlhf.algorithms.advantage import GAE
from xrlhf.algorithms.base import check_mini_batch, register_algorithm
from xrlhf.algorithms.critic import Critic
from xrlhf.algorithms.off_policy import OffPolicy
from xrlhf.algorithms.policy_gradient import PolicyGradient, gae_step
from xrlhf.algorithms.spec import Algorithm
from xrlhf.config.schema import Strict, XConfig


class OffPolicyConfig(Strict):
    """``algorithm.off_policy``: weight each token's policy gradient by ``w = pi_old / pi_rollout``
    (``off_policy.is_weights``; docs/algorithms.md, "Off-policy correction")."""

    correction: Literal["none", "tis", "mis"] = Field(
        "tis", description="none: measure only; tis: w <- min(w, cap); mis: tokens (or sequences) with w outside "
        "bounds are left out of the loss")
    level: Literal["token", "sequence"] = Field(
        "token", description="token: one weight per token; sequence: exp(sum of the response's log-ratios) on "
        "each of its tokens")
    cap: float = Field(2.0, gt=0, description="tis: the truncation")
    bounds: tuple[float, float] = Field((0.5, 2.0), description="mis: [lo, hi], kept where lo <= w <= hi")

    @field_validator("bounds")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= v[0] < v[1]:
            raise ValueError(f"[lo, hi] needs 0 <= lo < hi, got {list(v)}")
        return v

    def spec(self) -> OffPolicy:
        """The options as the loss takes them."""
        return OffPolicy(self.correction, self.level, self.cap, tuple(self.bounds))


class PolicyGradientConfig(Strict):
    """Options shared by PPO and the critic-free trainers (``algorithm:`` section)."""

    name: str = "ppo"
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout")
    mini_batch_size: int = Field(32, ge=1, description="samples per optimizer step (global)")
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip (DAPO clip-higher); default clip_eps")
    kl_coef: float = Field(0.05, ge=0, description="initial KL coefficient (0: no reference needed)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="per-token KL estimator of d = log pi_ref - log pi: k1 -d, k2 d^2/2 (both unclamped), "
        "k3 exp(d)-d-1 with d clamped to [-20, 20] (verl/OpenRLHF clamp the estimate itself to +-10)")
    kl_target: float | None = Field(None, gt=0, description="adaptive KL controller target in nats per SEQUENCE "
                                    "(the summed per-token KL, batch mean: kl/mean); verl and OpenRLHF use a "
                                    "per-token mean, smaller by about the response length. None: fixed kl_coef")
    kl_horizon: int = Field(10000, ge=1, description="samples over which a full-size KL coefficient correction acts")
    kl_in_reward: bool = Field(True, description="KL as a per-token reward penalty (True) or a loss term")
    entropy_coef: float = Field(0.0, ge=0)
    log_entropy: bool = Field(False, description="report policy/entropy (computed anyway when entropy_coef > 0); "
                              "costs a softmax over the vocabulary per response token")
    whiten_advantages: bool = True
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling vs rollout logprobs")
    off_policy: OffPolicyConfig | None = Field(None, description="off-policy correction (asynchronous rollouts); "
                                               "replaces tis_cap")


class PPOConfig(PolicyGradientConfig):
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    value_clip_eps: float | None = Field(0.2, gt=0)


def off_policy_errors(cfg: XConfig, o: PolicyGradientConfig) -> list[str]:
    """``algorithm.off_policy`` against ``tis_cap`` and ``rollout.max_staleness``; options the
    chosen correction does not use are errors, not silently ignored."""
    op, errors = o.off_policy, []
    if op is not None and o.tis_cap is not None:
        errors.append(f"algorithm.off_policy: set together with algorithm.tis_cap ({o.tis_cap}); tis_cap is "
                      f"off_policy {{correction: tis, level: token, cap: {o.tis_cap}}}: remove one of them")
    elif cfg.rollout.max_staleness > 0 and o.tis_cap is None and (op is None or op.correction == "none"):
        errors.append("algorithm.off_policy: max_staleness > 0 trains on samples of older policies; add "
                      "algorithm.off_policy: {correction: tis} (or mis), or set tis_cap")
    if op is not None:
        unused = {"cap": op.correction != "tis", "bounds": op.correction != "mis"}
        for key in sorted(op.model_fields_set & {k for k, u in unused.items() if u}):
            errors.append(f"algorithm.off_policy.{key}: not used by correction {op.correction!r} "
                          f"({'tis' if key == 'cap' else 'mis'} only); remove it")
    return errors


def policy_gradient_errors(cfg: XConfig, o: PolicyGradientConfig) -> list[str]:
    """The checks PPO, the critic-free estimators and distillation share (besides ``common_errors``)."""
    errors = check_mini_batch(cfg, o.mini_batch_size)
    if o.kl_coef > 0 and cfg.reference is None:
        errors.append("reference: algorithm.kl_coef > 0 needs a reference section (reference: {} uses the "
                      "policy's initial model); or set algorithm.kl_coef: 0")
    return errors + off_policy_errors(cfg, o)


def policy_gradient_steps(cfg: XConfig, o: PolicyGradientConfig) -> dict[str, int]:
    """``ppo_epochs`` x mini-batches per step, for the policy and a critic."""
    batch = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    n = cfg.trainer.steps * o.ppo_epochs * (batch // o.mini_batch_size)
    return {"policy": n, "critic": n}


def reads_rollout_logprobs(o: PolicyGradientConfig) -> bool:
    """Truncated importance sampling and the off-policy corrections weigh by the sampler's logprobs."""
    return o.tis_cap is not None or o.off_policy is not None


def ppo_parts(o: PPOConfig, loop) -> PolicyGradient:
    """PPO's update: GAE over the critic's values; the critic trained beside the policy."""
    return PolicyGradient(loop, o, GAE(o.gamma, o.lam, o.whiten_advantages, o.kl_in_reward), gae_step,
                          critic=Critic(loop.critic, o.value_clip_eps))


PPO = register_algorithm("ppo")(Algorithm(
    PPOConfig, ppo_parts, checks=policy_gradient_errors, steps=policy_gradient_steps,
    behaviour_logprobs=reads_rollout_logprobs, needs_critic=True, learns_off_policy=True))
"""PPO with a learned critic and GAE (behaviour logprobs are the rollout's; the update corrects for them)."""
