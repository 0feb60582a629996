"""PPO with a critic and GAE (Schulman et al. 2017; Ouyang et al. 2022 for the RLHF form).

One update, as in the paper's pseudocode::

    old logprobs, reference logprobs, values  <- policy, reference, critic (in parallel)
    token rewards = score on the last token - kl_coef * KL(policy || reference)
    advantages, returns = GAE(token rewards, values); whiten advantages
    for epoch in ppo_epochs: for mini-batch: policy step (clipped), critic step (clipped)
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, field_validator

from xrlhf.algorithms import functional as F
from xrlhf.algorithms.advantage import GAE
from xrlhf.algorithms.base import RLTrainer, Rollout, check_mini_batch, register_algorithm
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.algorithms.off_policy import OffPolicy
from xrlhf.algorithms.policy_update import PolicyUpdate, policy_loss
from xrlhf.algorithms.scoring import Scoring
from xrlhf.config.schema import Strict, XConfig
from xrlhf.data.batch import Batch


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


class PolicyGradientTrainer(RLTrainer):
    """The machinery PPO and the critic-free estimators share, as parts: ``scoring`` (old and
    reference logprobs, KL, values), ``policy_update`` (mini-batch epochs of the loss) and the
    KL controller ``kl_ctl``; a subclass sets ``advantage`` and writes ``update``."""

    Config = PolicyGradientConfig
    learns_off_policy = True  # behaviour logprobs are the rollout's; the update corrects for them

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        o = self.options
        self.kl_ctl = (F.AdaptiveKLController(o.kl_coef, o.kl_target, o.kl_horizon) if o.kl_target
                       else F.FixedKLController(o.kl_coef))
        self.scoring = Scoring(self.policy, self.reference if o.kl_coef > 0 else None, self.critic, o.kl_estimator)
        self.policy_update = PolicyUpdate(self.policy, self.critic, o, self.kl_ctl, self.generator)

    @classmethod
    def reads_behaviour_logprobs(cls, cfg: XConfig, options: PolicyGradientConfig) -> bool:
        """Truncated importance sampling and the off-policy corrections weigh by them."""
        return options.tis_cap is not None or options.off_policy is not None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.kl_ctl.load_state_dict(state["kl_ctl"])

    @classmethod
    def check_config(cls, cfg: XConfig, o) -> list[str]:
        errors = super().check_config(cfg, o)
        errors += check_mini_batch(cfg, o.mini_batch_size)
        if o.kl_coef > 0 and cfg.reference is None:
            errors.append("reference: algorithm.kl_coef > 0 needs a reference section (reference: {} uses the "
                          "policy's initial model); or set algorithm.kl_coef: 0")
        return errors + off_policy_errors(cfg, o)

    @classmethod
    def train_steps(cls, cfg: XConfig, o) -> dict[str, int]:
        batch = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
        n = cfg.trainer.steps * o.ppo_epochs * (batch // o.mini_batch_size)
        return {"policy": n, "critic": n}

    def policy_loss(self, on_policy: bool = False, staleness_bins: tuple[int, ...] = ()) -> PolicyLoss:
        """The policy's loss (``policy_update.policy_loss``); ``on_policy``: the old logprobs are
        the train forward's own (``reuses_train_forward``), with the mismatch reported by
        ``staleness_bins``."""
        return policy_loss(self.options, self.kl_ctl.value, on_policy, staleness_bins)

    def reuses_train_forward(self, batch: Batch) -> bool:
        """Whether the update of ``batch`` is one on-policy step: one epoch over one mini-batch,
        no dropout, and no KL needed before the advantages (``kl_in_reward`` off or ``kl_coef``
        0). The "old" policy is then the one the train step starts from, so no forward computes
        its logprobs: the loss takes the train forward's own (``PolicyLoss.on_policy``; the same
        loss and gradient) and reports the mismatch metrics that forward's caller would have. TRL
        and verl skip it there too. The reference's and a critic's forwards still run."""
        o = self.options
        return (o.ppo_epochs == 1 and o.mini_batch_size >= len(batch) and not self.run.policy_dropout
                and (not o.kl_in_reward or o.kl_coef == 0))

    def score_logprobs(self, batch: Batch, timings: dict[str, float], with_values: bool) -> dict[str, float]:
        """Old logprobs (unless ``reuses_train_forward``), reference logprobs (and critic values)
        for ``batch``, in parallel (``Scoring``); then ``kl/coef``."""
        with self.timeline.span("trainer", "infer"):
            metrics = self.scoring.score(batch, self.step_idx, timings, self.reuses_train_forward(batch), with_values)
            self.mark_memory("infer")
            metrics["kl/coef"] = self.kl_ctl.value
            return metrics

    def train_epochs(self, batch: Batch, with_critic: bool) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch steps; policy and critic step side by side (``PolicyUpdate``)."""
        with self.timeline.span("trainer", "train"):
            return self.policy_update.train(batch, self.step_idx, with_critic)


@register_algorithm("ppo")
class PPOTrainer(PolicyGradientTrainer):
    """PPO with a learned critic and GAE."""

    Config = PPOConfig
    needs_critic = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        o = self.options
        self.advantage = GAE(o.gamma, o.lam, o.whiten_advantages, o.kl_in_reward)

    def update(self, rollout: Rollout, timings: dict[str, float]) -> dict[str, float]:
        batch = rollout.batch
        metrics = self.score_logprobs(batch, timings, with_values=True)
        mask = batch["response_mask"]
        out = self.advantage.compute(batch, self.kl_ctl.value)
        batch["advantages"], batch["returns"] = out["advantages"], out["returns"]
        t0 = time.time()
        metrics.update(self.train_epochs(batch, with_critic=True))
        timings["time/train_s"] = time.time() - t0
        self.kl_ctl.update(metrics.get("kl/mean", 0.0), len(batch))
        metrics["critic/return_mean"] = float(F.masked_mean(out["returns"], mask))
        metrics["policy/loss"] = metrics.get("policy/loss", 0.0)
        metrics["critic/loss"] = metrics.get("critic/loss", 0.0)
        return metrics
