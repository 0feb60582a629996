"""The offline trainer: the shared loop with a dataset where the rollout would be.

DPO, offline KTO and reward-model training learn from a fixed table of rows instead of
sampled responses. ``OfflineTrainer`` is ``RLTrainer``'s sibling under ``Trainer`` (the same
``fit``: evaluate, ``steps`` x ``step()``, evaluate) whose ``step`` takes the next
``batch_size`` rows of a seeded shuffle of the dataset (``data.datasets.EpochOrder``) and hands
them to its step part (``RowStep``: ``DPOStep``, ``KTOStep``, ``PairwiseStep``), built by the
registration's ``Algorithm.parts`` (STYLE 19: the varying part is passed in). The position in
the shuffled stream is ``self.data_pos``, one integer, as for the online trainers, so a resumed
run continues where it stopped.

Sequence layout helpers used by all three live here too: pairs are interleaved
``[chosen_0, rejected_0, chosen_1, ...]`` so that any even-sized micro-batch or data-parallel
shard holds whole pairs (see ``xrlhf.algorithms.losses``).
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any, ClassVar, Sequence

import torch
from pydantic import Field

from xrlhf.algorithms import functional as F
from xrlhf.algorithms.base import Trainer
from xrlhf.config.schema import Strict, XConfig
from xrlhf.data.batch import Batch, build_sequences
from xrlhf.data.datasets import PREFERENCE, DatasetPath, EpochOrder, RowSchema, Rows, load_rows
from xrlhf.data.text import encode_prompt, encode_target
from xrlhf.utils.errors import UserError


class OfflineConfig(Strict):
    """Options shared by the dataset-driven trainers (``algorithm:`` section)."""

    name: str
    dataset: DatasetPath = Field(description="a JSONL / parquet file (xrlhf make-dataset writes one)")
    batch_size: int = Field(32, ge=1, description="rows (pairs, for pair datasets) per optimizer step")


def sequence_logps(handle, batch: Batch) -> torch.Tensor:
    """Sequence log-probs ``[B]`` of ``batch``'s responses under a causal-LM handle (no grad)."""
    out = handle.infer(batch.select("input_ids", "attention_mask", "response_mask"))
    return F.sequence_logprob(out["logprobs"], batch["response_mask"])


def pair_batch(prompts: Sequence[list[int]], chosen: Sequence[list[int]], rejected: Sequence[list[int]],
               pad_id: int) -> Batch:
    """``N`` pairs as ``2N`` interleaved rows ``[c_0, r_0, c_1, r_1, ...]`` (layout of ``data.batch``)."""
    doubled = [p for p in prompts for _ in range(2)]
    responses = [x for c, r in zip(chosen, rejected) for x in (c, r)]
    return build_sequences(doubled, responses, pad_id)


class RowStep:
    """An offline algorithm's step part: ``encode(row)`` (text -> token ids, once, at start) and
    ``train_on(items)`` (one optimizer step on encoded rows, its metrics).

    Built by the registration's ``parts(options, trainer)``; it reads the trainer's ``tok``,
    ``policy`` and ``reference``. An item is a tuple whose first element is the prompt's ids.
    """

    schema: ClassVar[RowSchema]
    """The dataset's row format."""
    rows_per_item: ClassVar[int] = 1
    """Sequences per dataset row in a training batch (2 for preference pairs)."""

    def __init__(self, options: Any, trainer: Trainer):
        self.options, self.tok = options, trainer.tok
        self.policy, self.reference = trainer.policy, trainer.reference

    def encode(self, row: dict[str, Any]) -> Any:
        """Token ids of one dataset row, in whatever form ``train_on`` wants."""
        raise NotImplementedError

    def train_on(self, items: list[Any]) -> dict[str, float]:
        """One optimizer step of the algorithm on encoded rows; returns its metrics."""
        raise NotImplementedError

    def responses(self, item: Any) -> list[list[int]]:
        """The response ids of an item (the model's length limit applies to prompt + each)."""
        return list(item[1:])

    def held_out(self, items: list[Any], rows: Rows) -> tuple[list[Any], Any]:
        """The items to train on and the evaluator of what is held out (``None``: the env's)."""
        return items, None

    def encode_prompt(self, text: str) -> list[int]:
        return encode_prompt(self.tok, text)

    def encode_response(self, text: str) -> list[int]:
        return encode_target(self.tok, text)


class PairStep(RowStep):
    """A step on ``{prompt, chosen, rejected}`` rows (DPO's, the reward model's): an item is
    ``(prompt ids, chosen ids, rejected ids)``."""

    schema = PREFERENCE
    rows_per_item = 2

    def encode(self, row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        return (self.encode_prompt(row["prompt"]), self.encode_response(row["chosen"]),
                self.encode_response(row["rejected"]))


class OfflineTrainer(Trainer):
    """A ``Trainer`` whose step trains on dataset rows instead of a rollout.

    Args (besides ``Trainer``'s):
        algorithm: the registration (``algorithms/spec.py:Algorithm``): its ``parts(options,
            trainer)`` builds the step part (``RowStep``); its ``progress_keys`` are the
            progress line's.
    """

    def __init__(self, *args, algorithm, **kwargs):
        super().__init__(*args, **kwargs)
        self.algorithm = algorithm
        self.progress_keys = algorithm.progress_keys
        self.uses_generation = algorithm.uses_generation
        self.part: RowStep = algorithm.parts(self.options, self)
        """The algorithm: from encoded rows to updated policy weights."""
        self.rows: Rows = load_rows(self.options.dataset, self.part.schema)
        items = [self._encode_checked(i) for i in range(len(self.rows))]
        self.items, evaluator = self.part.held_out(items, self.rows)
        if evaluator is not None:
            self.evaluator = evaluator
        self._stale = False

    # -- data -------------------------------------------------------------------------------
    def _encode_checked(self, i: int) -> Any:
        item = self.part.encode(self.rows[i])
        longest = max(len(item[0]) + len(r) for r in self.part.responses(item))
        limit = getattr(self.tok, "model_max_length", None) or 0
        if 0 < limit < 10**6 and longest > limit:
            raise UserError(f"{self.rows.where(i)}: prompt + response are {longest} tokens, more than the "
                            f"model's {limit}; shorten the row or drop it")
        return item

    @cached_property
    def order(self) -> EpochOrder:
        """The epoch-wise seeded shuffle of ``items`` (after the step part held some rows out)."""
        return EpochOrder(len(self.items), self.run.seed, "offline")

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` row indices of the epoch-wise seeded shuffle; advances ``data_pos``."""
        out = self.order.take(self.data_pos, n)
        self.data_pos += n
        return out

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One optimizer step on the next ``batch_size`` rows."""
        t0 = time.time()
        items = [self.items[i] for i in self.next_indices(self.options.batch_size)]
        metrics = self.part.train_on(items)
        self._stale = True
        return {**metrics, "time/update_s": time.time() - t0}

    def evaluate(self) -> dict[str, float]:
        """The generate engine gets the new weights only when they are needed: before an eval."""
        if self._stale and self.uses_generation:
            self.handles.sync_weights()
            self._stale = False
        return super().evaluate()


def offline_errors(cfg: XConfig, o: OfflineConfig, step: type[RowStep], reference: bool) -> list[str]:
    """The checks of every offline algorithm besides ``common_errors``: whole rows per rank, whole
    pairs per micro-batch (a ``step`` of 2 rows per item), a reference model (``reference``: the
    step scores with it)."""
    errors = []
    # The losses count rows: a padding copy would weigh in the mean, so the dispatch cannot
    # pad a train step, and each rank must get whole pairs (``data.dispatch``).
    if o.batch_size % cfg.policy.resources.ranks:
        errors.append(f"algorithm.batch_size: {o.batch_size} must divide by policy.resources.ranks = "
                      f"{cfg.policy.resources.ranks} (the loss is a mean over rows: every rank trains on "
                      f"as many whole rows)")
    if step.rows_per_item == 2 and cfg.policy.train.micro_batch_size % 2:
        errors.append(f"policy.train.micro_batch_size: {cfg.policy.train.micro_batch_size} must be even: "
                      f"a micro-batch holds whole (chosen, rejected) pairs")
    if reference and cfg.reference is None:
        errors.append(f"reference: algorithm {cfg.algorithm.name!r} needs a frozen reference model "
                      f"(reference: {{}} uses the policy's initial model)")
    return errors


def offline_steps(cfg: XConfig, o: OfflineConfig) -> dict[str, int]:
    """One policy optimizer step per step."""
    return {"policy": cfg.trainer.steps}


def prefixed(metrics: dict[str, float], prefix: str = "policy/") -> dict[str, float]:
    """Engine metrics (``loss``, ``grad_norm``, ...) under ``prefix``; keys with a '/' kept."""
    return {(k if "/" in k else prefix + k): v for k, v in metrics.items()}
