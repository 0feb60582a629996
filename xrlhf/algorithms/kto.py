"""KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"),
offline from a labelled dataset and online from the policy's own samples.

KTO needs only a desirable / undesirable label per completion, not pairs. Against a frozen
reference ``pi_ref``, with ``r(x, y) = log pi(y|x) - log pi_ref(y|x)``::

    z_ref = max(0, mean_i [log pi(y_j(i) | x_i) - log pi_ref(y_j(i) | x_i)])   (no gradient)
    loss(x, y) = w_d * (1 - sigmoid(beta * (r - z_ref)))   if y is desirable
                 w_u * (1 - sigmoid(beta * (z_ref - r)))   if y is undesirable

``z_ref`` estimates KL(pi || pi_ref) on MISMATCHED pairs: completion ``y_j(i)`` of another
prompt, scored under prompt ``x_i``, as in the paper and TRL. Here ``j(i)`` is the cyclic
shift of the batch by the smallest number of rows that gives every row a completion of a
different prompt (``mismatch_index``): by one row for an offline batch of distinct prompts,
by ``n`` rows for an online batch of ``n`` samples per prompt. ``z_ref`` is recomputed with
the current policy before every optimizer step, over the whole (global) mini-batch.

* ``kto`` (offline): ``{prompt, completion, label}`` rows from ``algorithm.dataset``.
* ``kto_online``: each step the policy samples ``trainer.samples_per_prompt`` completions per
  prompt, the reward source scores them, a completion is desirable iff its reward >=
  ``algorithm.threshold``, then ``epochs`` passes of KTO steps (``filter_uniform_groups``: only
  prompts whose samples got both labels, as DAPO's dynamic sampling).

``balance_ratio`` computes ``w_d`` from each update's counts of desirable and undesirable rows
(the paper's ``w_d n_d / (w_u n_u)`` in ``[1, 4/3]``, which fixed weights cannot keep online),
over the batch or, with ``balance_per_prompt``, within each prompt's samples; why the latter
matters online: docs/algorithms.md.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch
from pydantic import Field

from xrlhf.algorithms import functional as F
from xrlhf.algorithms.base import RL_PROGRESS, Rollout, check_mini_batch, register_algorithm
from xrlhf.algorithms.losses import KTOLoss
from xrlhf.algorithms.offline import (OfflineConfig, OfflineTrainer, RowStep, offline_errors, offline_steps, prefixed,
                                      sequence_logps)
from xrlhf.algorithms.spec import Algorithm
from xrlhf.config.schema import Strict, XConfig
from xrlhf.data.batch import Batch, build_sequences, response_loss_masks, unpack_sequences
from xrlhf.data.datasets import KTO

TRAIN_KEYS = ("input_ids", "attention_mask", "response_mask", "ref_logps", "labels", "desirable_weight", "z_ref")


class KTOOptions(Strict):
    """The loss options shared by offline and online KTO."""

    beta: float = Field(0.1, gt=0, description="temperature of the implied reward")
    desirable_weight: float = Field(1.0, gt=0, description="w_d; the paper keeps w_d n_d / (w_u n_u) in [1, 4/3]")
    undesirable_weight: float = Field(1.0, gt=0, description="w_u")
    balance_ratio: float | None = Field(None, gt=0, description="set w_d from the class counts of the rows of "
                                        "each update (a rollout online, a batch offline) so that w_d n_d / (w_u n_u) "
                                        "= balance_ratio (the paper recommends [1, 4/3]); desirable_weight unused")
    balance_per_prompt: bool = Field(False, description="with balance_ratio: keep the ratio within each prompt's "
                                                        "rows (and so over all rows), not only over all rows")

    def kto_errors(self) -> list[str]:
        """Cross-option checks shared by offline and online KTO."""
        errors = []
        if self.balance_ratio is not None and "desirable_weight" in self.model_fields_set:
            errors.append(f"algorithm.desirable_weight: not used with algorithm.balance_ratio = "
                          f"{self.balance_ratio} (w_d then follows each step's class counts); remove one of them")
        if self.balance_per_prompt and self.balance_ratio is None:
            errors.append("algorithm.balance_per_prompt: needs algorithm.balance_ratio (e.g. 1.0)")
        return errors

    def desirable_weights(self, labels: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor | float:
        """``w_d`` for a step's rows (labels and prompts ``[B]``): the scalar option, or ``[B]``
        balanced weights."""
        if self.balance_ratio is None:
            return self.desirable_weight
        groups = group_ids if self.balance_per_prompt else torch.zeros_like(group_ids)
        return F.kto_balanced_desirable_weights(labels, groups, self.balance_ratio, self.undesirable_weight)


class KTOConfig(OfflineConfig, KTOOptions):
    """``algorithm:`` section of offline KTO."""

    name: str = "kto"


class KTOOnlineConfig(KTOOptions):
    """``algorithm:`` section of online KTO."""

    name: str = "kto_online"
    threshold: float = Field(0.5, description="a sample is desirable iff its reward >= threshold")
    filter_uniform_groups: bool = Field(False, description="train only on prompts whose samples got both labels "
                                                           "(DAPO's dynamic sampling)")
    epochs: int = Field(1, ge=1, description="passes over each rollout")
    mini_batch_size: int = Field(64, ge=1, description="samples per optimizer step (global)")


def mismatch_index(group_ids: torch.Tensor) -> torch.Tensor:
    """For each row ``i`` a row ``j(i)`` answering another prompt: a cyclic shift of the batch.

    The shift is the smallest ``k >= 1`` for which every row's partner ``(i + k) mod B`` has a
    different group id; if no shift does (a single prompt), ``k = 1``.

    Args:
        group_ids: ``[B]`` the prompt of each row.
    Returns:
        ``[B]`` long indices.
    """
    b = group_ids.shape[0]
    rows = torch.arange(b)
    for k in range(1, b):
        j = (rows + k) % b
        if bool((group_ids[j] != group_ids).all()):
            return j
    return (rows + 1) % max(b, 1)


class KTOPairs:
    """The KTO update shared by offline KTO's step and online KTO's update: the mismatched pairs
    with their reference log-probs, and one optimizer step."""

    def __init__(self, policy, reference, options: KTOOptions, pad_id: int):
        self.policy, self.reference, self.options, self.pad_id = policy, reference, options, pad_id

    def batches(self, prompts: list[list[int]], completions: list[list[int]], labels: torch.Tensor,
                group_ids: torch.Tensor, masks: list[list[float]] | None = None) -> tuple[Batch, Batch]:
        """The training rows ``(x_i, y_i)`` and the mismatched rows ``(x_i, y_j(i))``, each with
        its reference sequence log-probs ``ref_logps`` ``[B]`` (one reference call for both).
        ``masks``: the completions' loss masks (an episode's observations are 0)."""
        b = len(prompts)
        j = mismatch_index(group_ids).tolist()
        full = build_sequences(prompts + prompts, completions + [completions[k] for k in j], self.pad_id,
                               response_masks=None if masks is None else masks + [masks[k] for k in j])
        ref = sequence_logps(self.reference, full)
        train, kl = full.index(slice(0, b)), full.index(slice(b, 2 * b))
        train["ref_logps"], kl["ref_logps"] = ref[:b], ref[b:]
        train["labels"] = labels.float()
        # w_d from the class counts of all the rows (the whole rollout online), not of each
        # mini-batch: a mini-batch holds a random part of a prompt's samples
        train["desirable_weight"] = torch.as_tensor(self.options.desirable_weights(labels.bool(), group_ids),
                                                    dtype=torch.float32).expand(b).clone()
        return train, kl

    def step(self, train: Batch, kl: Batch) -> dict[str, float]:
        """One optimizer step on ``train``, with ``z_ref`` from the current policy on ``kl``."""
        z = F.kto_reference_point(sequence_logps(self.policy, kl), kl["ref_logps"])
        train["z_ref"] = z.expand(len(train)).clone()
        loss = KTOLoss(self.options.beta, self.options.desirable_weight, self.options.undesirable_weight)
        metrics = prefixed(self.policy.train_step(train.select(*TRAIN_KEYS), loss))
        labels = train["labels"].bool()
        metrics["kto/desirable_fraction"] = float(labels.float().mean())
        if labels.any():
            metrics["kto/desirable_weight"] = float(train["desirable_weight"][labels].mean())
        return metrics


class KTOStep(RowStep):
    """Offline KTO's step on ``{prompt, completion, label}`` rows (``KTOPairs``)."""

    schema = KTO

    def __init__(self, options: KTOConfig, trainer):
        super().__init__(options, trainer)
        self.pairs = KTOPairs(self.policy, self.reference, options, self.tok.pad_token_id)

    def encode(self, row: dict[str, Any]) -> tuple[list[int], list[int], bool, int]:
        # the prompt's hash is its group id: two rows of one prompt are never each other's mismatch
        return (self.encode_prompt(row["prompt"]), self.encode_response(row["completion"]), row["label"],
                zlib.crc32(row["prompt"].encode()))

    def responses(self, item: Any) -> list[list[int]]:
        return [item[1]]

    def train_on(self, items: list[tuple[list[int], list[int], bool, int]]) -> dict[str, float]:
        prompts, completions, labels, groups = zip(*items)
        train, kl = self.pairs.batches(list(prompts), list(completions), torch.tensor(labels),
                                       torch.tensor(groups, dtype=torch.long))
        return self.pairs.step(train, kl)


def kto_errors(cfg: XConfig, o: KTOConfig) -> list[str]:
    """Offline KTO's checks besides ``common_errors``: whole rows per rank, a reference, the options."""
    return offline_errors(cfg, o, KTOStep, reference=True) + o.kto_errors()


KTO_OFFLINE = register_algorithm("kto")(Algorithm(
    KTOConfig, KTOStep, checks=kto_errors, steps=offline_steps, schema=KTOStep.schema, loop=OfflineTrainer,
    progress_keys=(("policy/loss", "loss"), ("kto/kl", "z_ref"), ("kto/rewards_chosen", "r_des"),
                   ("kto/rewards_rejected", "r_undes"))))
"""Offline KTO: an ``OfflineTrainer`` with a ``KTOStep``."""


class KTOOnline:
    """Online KTO's update: the policy's samples, labelled by reward >= threshold, trained with
    KTO (``epochs`` passes of mini-batch steps, the trainer's generator shuffling them)."""

    def __init__(self, options: KTOOnlineConfig, loop):
        self.options, self.loop = options, loop
        self.generator = loop.generator
        self.pairs = KTOPairs(loop.policy, loop.reference, options, loop.tok.pad_token_id)

    def keeps_group(self, scores: torch.Tensor) -> bool:
        """Dynamic sampling keeps a prompt whose samples got both labels (``filter_uniform_groups``'
        rule, applied while generating instead of after)."""
        labels = scores >= self.options.threshold
        return bool(labels.any() and not labels.all())

    def __call__(self, rollout: Rollout, timings: dict[str, float]) -> dict[str, float]:
        t0 = time.time()
        batch = rollout.batch
        labels = batch["scores"] >= self.options.threshold
        keep = self.kept_rows(labels, batch["group_ids"])
        metrics = {"kto/desirable_fraction": float(labels.float().mean()),
                   "kto/kept_fraction": len(keep) / len(batch)}
        if len(keep) == 0:
            return metrics
        batch = batch.index(keep)
        prompts, completions = unpack_sequences(batch)
        train, kl = self.pairs.batches(prompts, completions, labels[keep], batch["group_ids"],
                                       response_loss_masks(batch))
        timings["time/infer_s"] = time.time() - t0
        self.loop.mark_memory("infer")
        t0 = time.time()
        sums: dict[str, float] = {}
        n = 0
        for _ in range(self.options.epochs):
            perm = torch.randperm(len(train), generator=self.generator)
            for idx in perm.split(self.options.mini_batch_size):
                for k, v in self.pairs.step(train.index(idx), kl.index(idx)).items():
                    sums[k] = sums.get(k, 0.0) + v
                n += 1
        timings["time/train_s"] = time.time() - t0
        return {**{k: v / max(n, 1) for k, v in sums.items()}, **metrics}

    def kept_rows(self, labels: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """Indices of the rows to train on: all of them, or with ``filter_uniform_groups`` only
        the prompts whose samples got both labels (at least two such prompts, for the
        mismatched pairs). Any count trains: the dispatch pads a data-parallel split with copies
        that KTO's loss leaves out (``row_weight``, ``data.dispatch``)."""
        rows = torch.arange(len(labels))
        if self.options.filter_uniform_groups:
            mixed = torch.tensor([bool(labels[group_ids == g].any() and not labels[group_ids == g].all())
                                  for g in group_ids.tolist()])
            rows = rows[mixed]
            if len(group_ids[rows].unique()) < 2:
                return rows[:0]
        return rows

    def evaluation(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def kto_online_errors(cfg: XConfig, o: KTOOnlineConfig) -> list[str]:
    """Online KTO's checks besides ``common_errors``: the mini-batch, a reference, two prompts per step."""
    errors = check_mini_batch(cfg, o.mini_batch_size)
    if cfg.reference is None:
        errors.append("reference: kto_online needs a frozen reference model (reference: {} uses the "
                      "policy's initial model)")
    if cfg.trainer.prompts_per_step < 2:
        errors.append("trainer.prompts_per_step: KTO's reference point needs completions of at least 2 "
                      "prompts per step")
    return errors + o.kto_errors()


def kto_online_steps(cfg: XConfig, o: KTOOnlineConfig) -> dict[str, int]:
    """``epochs`` x mini-batches per step, for the policy."""
    batch = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    return {"policy": cfg.trainer.steps * o.epochs * (batch // o.mini_batch_size)}


KTO_ONLINE = register_algorithm("kto_online")(Algorithm(
    KTOOnlineConfig, KTOOnline, checks=kto_online_errors, steps=kto_online_steps,
    learns_off_policy=True,  # KTO's loss never uses the sampler's logprobs: any labelled sample teaches it
    progress_keys=(("kto/kl", "z_ref"), ("kto/desirable_fraction", "desirable"), *RL_PROGRESS)))
"""Online KTO: the policy's samples, labelled by reward >= threshold, trained with KTO."""
