"""Loss callables handed to train engines (picklable: they travel to Ray workers).

Each wraps pure functions of ``xrlhf.algorithms.functional`` and follows the ``LossFn``
contract of ``xrlhf.engines.base``: return the loss *summed* over its units plus metrics;
the engine normalises by the global unit count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from xrlhf.algorithms import functional as F
from xrlhf.algorithms.divergence import topk_reverse_kl
from xrlhf.algorithms.off_policy import OffPolicy, is_weights
from xrlhf.data.batch import Batch
from xrlhf.engines.base import ForwardOutput


@dataclass
class PolicyLoss:
    """PPO-clip policy loss (+ entropy bonus, + optional KL-to-reference term, + TIS or an
    off-policy correction).

    Reads ``old_logprobs``, ``advantages`` and ``response_mask`` from the batch; with
    ``kl_coef > 0`` also ``ref_logprobs``; with ``tis_cap`` or ``off_policy`` also
    ``rollout_logprobs``; with ``topk_coef > 0`` (top-k distillation) also ``teacher_topk_ids``
    and ``teacher_topk_logprobs`` ``[B, R, k]``, adding ``topk_coef`` times the top-k reverse KL
    to the teacher (``divergence.topk_reverse_kl``) summed over the tokens.

    ``tis_cap``: token TIS, each token's policy-gradient term times
    ``min(exp(old - rollout), tis_cap)`` (unchanged since before ``off_policy``).

    ``off_policy`` (``off_policy.is_weights``): each token's policy-gradient term times its
    behaviour weight; a token ``mis`` rejects is left out of the loss *sum* but still counts in
    the engine's denominator (all ``response_mask`` tokens), so a batch with many rejections takes
    a smaller step (as AReaL and slime do; verl differs: docs/algorithms.md, "The denominator").
    The entropy bonus and the KL term stay over every response token. The ``off_policy/*``
    metrics are means over the micro-batch's response tokens.

    Entropy: the engine computes it only when ``needs_entropy``: for the bonus
    (``entropy_coef != 0``) or for the ``policy/entropy`` metric (``log_entropy``). It costs a
    softmax over the vocabulary per token, so it is off unless asked for.

    ``on_policy``: the update is one on-policy step (one epoch, one mini-batch: the "old" policy
    is the one being trained), so ``old_logprobs`` are not read but are the forward's own,
    detached: the ratio is exactly 1 and the gradient the one a separate old-logprob forward
    gives (``PolicyGradient.reuses_train_forward``). The TIS / off-policy weight then
    compares them with ``rollout_logprobs``, and the loss reports what that forward's caller
    reported (``on_policy_metrics``): the mismatch to the rollout, and by staleness for the
    ``staleness_bins`` (read from the batch's ``staleness`` ``[B, R]``).
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    tis_cap: float | None = None
    unit: str = "token"
    row_weighted: bool = False
    off_policy: OffPolicy | None = None
    log_entropy: bool = False
    on_policy: bool = False
    staleness_bins: tuple[int, ...] = ()
    topk_coef: float = 0.0

    def __post_init__(self):
        if self.tis_cap is not None and self.off_policy is not None:
            raise ValueError("PolicyLoss takes tis_cap or off_policy, not both")

    @property
    def needs_entropy(self) -> bool:
        """The forward must compute the entropy: a bonus term or the metric asks for it."""
        return self.entropy_coef != 0 or self.log_entropy

    @property
    def gather_key(self) -> str | None:
        """With ``topk_coef``: the batch key of a distillation teacher's top-k ids ``[B, R, k]``,
        at which the forward gathers the student's logprobs (``ForwardOutput.gathered``)."""
        return "teacher_topk_ids" if self.topk_coef else None

    def __call__(self, out: ForwardOutput, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["response_mask"]
        old = out.logprobs.detach() if self.on_policy else mb["old_logprobs"]
        is_w, off = None, {}
        if self.tis_cap is not None:
            is_w = torch.exp(old - mb["rollout_logprobs"]).clamp(max=self.tis_cap)
        elif self.off_policy is not None:
            o = self.off_policy
            w, keep, off = is_weights(old, mb["rollout_logprobs"], mask, o.correction, o.level, o.cap, o.bounds)
            is_w = w * keep
        loss, stats = F.policy_loss(out.logprobs, old, mb["advantages"], mask, self.clip_eps, self.clip_eps_high,
                                    is_w)
        metrics = {f"policy/{k}": v for k, v in stats.items()}
        if self.on_policy and "rollout_logprobs" in mb:
            metrics.update(on_policy_metrics(old, mb["rollout_logprobs"], mask,
                                             mb["staleness"] if "staleness" in mb else None,
                                             self.staleness_bins))
        metrics.update({f"off_policy/{k}": v for k, v in off.items()})
        metrics["policy/pg_loss"] = loss.detach() / mask.sum().clamp(min=1)
        if out.entropy is not None:
            ent = F.masked_sum(out.entropy, mask)
            if self.entropy_coef:
                loss = loss - self.entropy_coef * ent
            metrics["policy/entropy"] = ent.detach() / mask.sum().clamp(min=1)
        if self.kl_coef > 0:
            kl = F.masked_sum(F.kl_estimate(out.logprobs, mb["ref_logprobs"], self.kl_estimator), mask)
            loss = loss + self.kl_coef * kl
            metrics["policy/kl_loss"] = kl.detach() / mask.sum().clamp(min=1)
        if self.topk_coef:  # top-k distillation: the divergence itself, differentiated directly
            kl = F.masked_sum(topk_reverse_kl(out.gathered, mb["teacher_topk_logprobs"], mask), mask)
            loss = loss + self.topk_coef * kl
            metrics["distill/topk_kl"] = kl.detach() / mask.sum().clamp(min=1)
        return loss, metrics


def on_policy_metrics(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                      staleness: torch.Tensor | None = None, bins: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """What the old-logprob forward's caller reported, from a micro-batch's own logprobs, as metrics
    the train template averages by tokens (``engines.training.unit_weighted_means``).

    Args:
        logprobs, rollout_logprobs, mask: ``[B, R]``.
        staleness: ``[B, R]`` how many policy versions each token's sampler was behind (needed
            with ``bins``).
        bins: the staleness values of the whole batch.

    Returns:
        ``mismatch/logprob_abs_diff_mean`` (token mean of ``|logprobs - rollout_logprobs|``) and
        ``_max``; per ``d`` of ``bins``, ``mismatch/abs_diff_sum_s{d}`` (the sum of the differences
        over the tokens of staleness ``d``) and ``mismatch/tokens_s{d}`` (their count), both divided
        by the micro-batch's tokens, so their token-weighted means over micro-batches and ranks
        divide into the batch's mean at staleness ``d`` (``PolicyGradient`` does).
    """
    diff = (logprobs - rollout_logprobs).abs() * mask
    tokens = mask.sum().clamp(min=1)
    out = {"mismatch/logprob_abs_diff_mean": diff.sum() / tokens, "mismatch/logprob_abs_diff_max": diff.max()}
    for d in bins:
        at = (staleness == d) & (mask != 0)
        out[f"mismatch/abs_diff_sum_s{d}"] = (diff * at).sum() / tokens
        out[f"mismatch/tokens_s{d}"] = at.sum() / tokens
    return out


@dataclass
class ValueLoss:
    """Clipped value loss; reads ``old_values``, ``returns`` and ``response_mask``."""

    clip_eps: float | None = 0.2
    unit: str = "token"
    needs_entropy: bool = False
    row_weighted: bool = False

    def __call__(self, out: ForwardOutput, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = F.value_loss(out.values, mb["old_values"], mb["returns"], mb["response_mask"], self.clip_eps)
        return loss, {f"critic/{k}": v for k, v in stats.items()}


@dataclass
class SFTLoss:
    """Negative log-likelihood of the response tokens (supervised warm-up, SFT)."""

    unit: str = "token"
    needs_entropy: bool = False
    row_weighted: bool = False

    def __call__(self, out: ForwardOutput, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["response_mask"]
        nll = -F.masked_sum(out.logprobs, mask)
        return nll, {"sft/token_accuracy": F.masked_mean((out.logprobs.detach() > -0.693).float(), mask)}


# -- sequence-level losses: one unit per row --------------------------------------------------
#
# DPO and the reward model train on pairs laid out interleaved, ``[chosen_0, rejected_0,
# chosen_1, ...]``, so a micro-batch (and a data-parallel shard) of even size always holds whole
# pairs. Each of a pair's two rows carries the pair's loss: the engine divides the sum by the
# number of rows, which then gives the mean over pairs.


def _pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2N]`` interleaved -> (chosen ``[N]``, rejected ``[N]``)."""
    if x.shape[0] % 2:
        raise ValueError(f"a pair batch needs an even number of rows, got {x.shape[0]}: make "
                         f"policy.train.micro_batch_size even")
    return x[0::2], x[1::2]


@dataclass
class KTOLoss:
    """KTO (``functional.kto_loss``) of each row against the frozen reference.

    Reads ``ref_logps`` ``[B]`` (reference sequence log-probs), ``labels`` ``[B]`` (1 =
    desirable), ``z_ref`` ``[B]`` (the batch's reference point, the same in every row: it is
    estimated by the trainer from mismatched pairs before the step), ``response_mask`` and,
    when present, ``desirable_weight`` ``[B]`` (per-row ``w_d`` of balanced weights, which then
    replaces the scalar ``desirable_weight``) and ``row_weight`` ``[B]`` (0 for the padding copies
    of a data-parallel split, which are left out: ``row_weighted``).
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    unit: str = "sequence"
    needs_entropy: bool = False
    row_weighted: bool = True

    def __call__(self, out: ForwardOutput, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logps = F.sequence_logprob(out.logprobs, mb["response_mask"])
        w_d = mb["desirable_weight"] if "desirable_weight" in mb else self.desirable_weight
        ref, labels, z = mb["ref_logps"], mb["labels"].bool(), mb["z_ref"][0]
        if "row_weight" in mb:  # a padded data-parallel part: the copies (weight 0) are left out
            real = mb["row_weight"] > 0
            logps, ref, labels = logps[real], ref[real], labels[real]
            w_d = w_d[real] if isinstance(w_d, torch.Tensor) else w_d
        loss, stats = F.kto_loss(logps, ref, labels, z, self.beta, w_d, self.undesirable_weight)
        return loss, {f"kto/{k}": v for k, v in stats.items()}


@dataclass
class DPOLoss:
    """DPO sigmoid loss (``functional.dpo_loss``) on interleaved chosen / rejected rows, plus
    optionally ``nll_weight`` times the chosen response's mean token NLL (RPO, Pang et al.
    2024, "Iterative Reasoning Preference Optimization"): a per-response token mean averaged
    over pairs. TRL 1.16 has no ``rpo_alpha``; its RPO is ``loss_type=["sigmoid", "sft"]``, whose
    SFT term is a token mean over all chosen tokens of the batch (docs/algorithms.md, DPO).

    Reads ``ref_logps`` ``[2N]`` (reference sequence log-probs, interleaved like the rows)
    and ``response_mask``.
    """

    beta: float = 0.1
    nll_weight: float = 0.0
    unit: str = "sequence"
    needs_entropy: bool = False
    row_weighted: bool = False
    rows_per_group: int = 2  # a micro-batch keeps a chosen / rejected pair together

    def __call__(self, out: ForwardOutput, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["response_mask"]
        pc, pr = _pairs(F.sequence_logprob(out.logprobs, mask))
        rc, rr = _pairs(mb["ref_logps"])
        loss, stats = F.dpo_loss(pc, pr, rc, rr, self.beta)
        metrics = {f"dpo/{k}": v for k, v in stats.items()}
        metrics["dpo/chosen_logp_change"] = (pc - rc).detach().mean()
        metrics["dpo/rejected_logp_change"] = (pr - rr).detach().mean()
        if self.nll_weight > 0:
            nll = -F.masked_mean(out.logprobs[0::2], mask[0::2], dim=-1)  # [N] mean NLL per chosen response
            loss = loss + self.nll_weight * nll.sum()
            metrics["dpo/chosen_nll"] = nll.detach().mean()
        return 2.0 * loss, metrics


@dataclass
class PairwiseRewardLoss:
    """Bradley-Terry loss (``functional.bradley_terry_loss``) of a score-head model on
    interleaved chosen / rejected rows; reads nothing but the model's ``scores`` ``[2N]``."""

    unit: str = "sequence"
    needs_entropy: bool = False
    row_weighted: bool = False
    rows_per_group: int = 2

    def __call__(self, out: ForwardOutput, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chosen, rejected = _pairs(out.scores)
        loss, stats = F.bradley_terry_loss(chosen, rejected)
        return 2.0 * loss, {f"rm/{k}": v for k, v in stats.items()}
