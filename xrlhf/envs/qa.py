"""``qa``: open prompts from a dataset, answered freely and scored by a reward model.

The RLHF setting of InstructGPT in miniature: there is no rule that says what a good answer
is, so ``reward_source = "model"`` and the trainer scores responses with the reward handle
(``reward.source: model``; a Python function by import path works too). Rows are
``{prompt, answer?}`` (JSONL or parquet, see ``xrlhf.data.datasets``); reference answers,
where present, feed the supervised warm-up (``sft_examples``) and an exact-match diagnostic
in evaluation (``eval/exact_match``), never the reward.

The held-out split is ``eval_dataset`` if given, else the rows whose prompt hashes into the
``eval_fraction`` (``xrlhf.data.datasets.held_out``): independent of the seed and of the row
order, so one prompt is never on both sides. The training stream visits the training rows in
a fresh seeded order each epoch; prompt ``i`` is a function of ``(seed, i)``.
"""

from __future__ import annotations

from functools import cached_property

from pydantic import Field, model_validator

from xrlhf.data.datasets import PROMPTS, DatasetPath, EpochOrder, load_rows, split_held_out
from xrlhf.envs.base import Env, EnvOptions, Prompt, register_env


class QAOptions(EnvOptions):
    """``env.options`` of the ``qa`` environment."""

    dataset: DatasetPath = Field(description="prompts {prompt, answer?}: .jsonl or .parquet")
    eval_dataset: DatasetPath | None = Field(None, description="held-out prompts (default: a split of dataset)")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="without eval_dataset: share of prompts held out")
    eval_size: int | None = Field(None, ge=1, description="use at most this many held-out prompts")

    @model_validator(mode="after")
    def _some_eval(self) -> "QAOptions":
        if self.eval_dataset is None and self.eval_fraction == 0:
            raise ValueError("env.options.eval_fraction: 0 holds no prompts out and there is no "
                             "env.options.eval_dataset; set one of them")
        return self


@register_env("qa")
class QAEnv(Env):
    """Prompts from a dataset; rewards come from the reward model (or a reward function)."""

    Config = QAOptions
    config: QAOptions
    reward_source = "model"
    schema = PROMPTS
    """The row format of the dataset options (``xrlhf validate`` checks every row)."""

    def max_prompt_tokens(self, tokenizer, sample: int = 0) -> int:
        """The longest prompt of every row, training and held-out."""
        from xrlhf.data.text import encode_prompt

        train, evals = self._splits
        return max(len(encode_prompt(tokenizer, p.text)) for p in {*train, *evals})

    @cached_property
    def _splits(self) -> tuple[list[Prompt], list[Prompt]]:
        o = self.config
        rows = load_rows(o.dataset, PROMPTS)
        if o.eval_dataset is not None:
            train, evals = rows.rows, load_rows(o.eval_dataset, PROMPTS).rows
        else:
            train, evals = split_held_out(rows.rows, [r["prompt"] for r in rows.rows], o.eval_fraction,
                                          path=rows.path, section="env.options", noun="prompts")
        evals = evals[:o.eval_size]
        return [_prompt(r, i) for i, r in enumerate(train)], [_prompt(r, i) for i, r in enumerate(evals)]

    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        """Prompts ``start .. start + n - 1``: epoch ``i // N`` is a seeded shuffle of the rows."""
        if start < 0 or n < 0:
            raise ValueError(f"qa: train_prompts(start={start}, n={n}) needs both >= 0")
        rows = self._splits[0]
        return [Prompt(text=rows[j].text, answer=rows[j].answer, task=rows[j].task, index=start + k)
                for k, j in enumerate(self._order.take(start, n))]

    @cached_property
    def _order(self) -> EpochOrder:
        return EpochOrder(len(self._splits[0]), self.seed, "qa")

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts (``eval_dataset``, or the hashed ``eval_fraction`` of ``dataset``)."""
        return list(self._splits[1])


def _prompt(row: dict, index: int) -> Prompt:
    return Prompt(text=row["prompt"], answer=row["answer"], task="qa", index=index)

