"""``dataset`` and ``dataset_chat``: prompts with reference answers read from a file, rewarded by
a verifier.

Why: RL with verifiable rewards mostly trains on someone's table of problems and answers (GSM8K,
MATH, a company's own), not on a generator. These envs read such a table (``.jsonl``,
``.parquet`` or a ``save_to_disk`` directory) and score each completion with a verifier
(:mod:`xrlhf.envs.verifiers`), so a new dataset needs a file and a YAML section, no code. Every
row is checked when the env first reads its data, each fault one line naming the file and row.
The held-out split follows the ``qa`` env (:func:`xrlhf.data.datasets.held_out`). ``dataset`` is
single-turn (the prompt as it is); ``dataset_chat`` renders the same rows as a one-turn chat
episode. Options, row numbering and errors: docs/algorithms.md ("The ``dataset`` environment").
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from loguru import logger
from pydantic import Field, ValidationInfo, field_validator, model_validator

from xrlhf.data.datasets import EpochOrder, split_held_out
from xrlhf.envs.base import Env, EnvOptions, Prompt, Score, check_pairs, clean_response, register_env
from xrlhf.envs.episode import Episode, EpisodeEnv, EpisodeOptions, Message, Turn
from xrlhf.envs.verifiers import Verify, answer_error, check_name, check_options, load_verifier
from xrlhf.utils.errors import UserError, first_line

SUFFIXES = (".jsonl", ".parquet")
"""The files a dataset may be (besides a ``save_to_disk`` directory)."""

MAX_REPORTED = 10
"""Bad rows reported one by one; the rest are counted."""


class DatasetOptions(EnvOptions):
    """``env.options`` of the ``dataset`` environment."""

    dataset: str = Field(description="rows {prompt, answer}: .jsonl, .parquet or a save_to_disk directory")
    split: str | None = Field(None, min_length=1, description="the split of a DatasetDict directory to train on "
                              "(default: its only split, else 'train')")
    eval_dataset: str | None = Field(None, description="held-out rows (default: a split of dataset)")
    eval_split: str | None = Field(None, min_length=1, description="the held-out split of a DatasetDict directory "
                                   "(of eval_dataset if given, else of dataset)")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="without eval_dataset / eval_split: share of "
                                 "prompts held out")
    eval_size: int | None = Field(None, ge=1, description="use at most this many held-out prompts")
    prompt_column: str = Field("prompt", min_length=1)
    answer_column: str = Field("answer", min_length=1)
    demonstration_column: str | None = Field(None, min_length=1, description="a worked answer: the warm-up's "
                                             "target instead of the answer")
    task_column: str | None = Field(None, min_length=1, description="a task name per row (per-task metrics)")
    verifier: str = Field("exact", description="exact, numeric, boxed or package.module:function")
    verifier_options: dict[str, Any] = Field(default_factory=dict, description="the verifier's options "
                                             "(numeric, boxed: rel_tol, abs_tol)")

    @field_validator("dataset", "eval_dataset")
    @classmethod
    def _exists(cls, v: str | None) -> str | None:
        if v is None:
            return v
        p = Path(v).expanduser()
        if p.is_dir():
            return str(p.resolve())
        if p.suffix not in SUFFIXES:
            missing = "" if p.exists() else "no such directory; "
            raise ValueError(f"{v!r}: {missing}a dataset is a .jsonl or .parquet file, or a directory written by "
                             f"datasets' save_to_disk")
        if not p.is_file():
            raise ValueError(f"no such file {v!r} (write an arithmetic one with: xrlhf make-dataset arithmetic {v})")
        return str(p.resolve())  # absolute: workers may start in another directory

    @field_validator("verifier")
    @classmethod
    def _verifier(cls, v: str) -> str:
        check_name(v)  # a user's verifier is imported here: a bad path is a config error
        return v

    @field_validator("verifier_options")
    @classmethod
    def _verifier_options(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "verifier" in info.data:  # else the name is wrong, and reported by itself
            check_options(info.data["verifier"], v)
        return v

    @model_validator(mode="after")
    def _splits(self) -> "DatasetOptions":
        errors = []
        if self.eval_dataset is None and self.eval_split is None and self.eval_fraction == 0:
            errors.append("env.options.eval_fraction: 0 holds no prompts out and there is no "
                          "env.options.eval_dataset or eval_split; set one of them")
        for option, path in (("split", self.dataset), ("eval_split", self.eval_dataset or self.dataset)):
            if getattr(self, option) is not None and not Path(path).is_dir():
                errors.append(f"env.options.{option}: {path} is a file, and only a directory written by "
                              f"datasets' save_to_disk has splits; remove it")
        if errors:
            raise ValueError("\n".join(errors))
        return self


@dataclass(frozen=True)
class Row:
    """One checked row.

    Attributes:
        prompt, answer: the row's prompt and reference answer (a number in the file: its text).
        target: what the warm-up trains: the demonstration, or the answer.
        task: the row's task (``task_column``), else ``"dataset"``.
    """

    prompt: str
    answer: str
    target: str
    task: str


@dataclass(frozen=True)
class _Unreadable:
    """A JSONL line that is not JSON."""

    reason: str


class _BadRow(Exception):
    """A row that fails a check; the message is what is wrong, without the place."""


def read_records(path: str, split: str | None = None, split_option: str = "split",
                 default_split: str | None = "train") -> list[tuple[str, Any]]:
    """The rows of a dataset as ``(where, record)`` pairs, unchecked.

    ``where`` is ``path:LINE`` (JSONL, 1-based) or ``path: row I`` (parquet, a datasets
    directory; 0-based). A JSONL line that is not JSON is an ``_Unreadable`` record, so that
    it is reported with the other bad rows.

    Args:
        path: a ``.jsonl`` or ``.parquet`` file, or a ``save_to_disk`` directory.
        split: the split of a ``DatasetDict`` directory (``None``: its only split, else
            ``default_split``); ``split_option`` is its option's name, for messages.

    Raises:
        UserError: one line for a missing file, a missing reader package (with the ``pip``
            command), a file that cannot be read.
    """
    p = Path(path)
    if p.is_dir():
        return _read_saved(path, split, split_option, default_split)
    if not p.is_file():
        raise UserError(f"{path}: no such file or directory")
    if p.suffix == ".jsonl":
        return _read_jsonl(path)
    if p.suffix == ".parquet":
        return [(f"{path}: row {i}", r) for i, r in enumerate(_parquet_records(path))]
    raise UserError(f"{path}: a dataset is a .jsonl or .parquet file, or a directory written by datasets' save_to_disk")


def _read_jsonl(path: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    out.append((f"{path}:{n}", json.loads(line.rstrip("\r\n"))))  # columns of this line
                except json.JSONDecodeError as e:
                    out.append((f"{path}:{n}", _Unreadable(f"not valid JSON ({e.msg}, column {e.colno}); "
                                                           f"each line must be one JSON object")))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); a .jsonl file is UTF-8") from None
    return out


def _parquet_records(path: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    try:
        if pq is not None:
            return pq.read_table(path).to_pylist()
        import pandas

        return pandas.read_parquet(path).to_dict("records")
    except ImportError:  # neither pyarrow nor pandas, or pandas without a parquet engine
        raise UserError(f"{path}: reading parquet needs the pyarrow package (or pandas with a parquet engine), "
                        f"which is not installed; install it with: pip install pyarrow") from None
    except Exception as e:  # noqa: BLE001 - pyarrow / pandas errors of many kinds
        raise UserError(f"{path}: cannot be read as parquet ({first_line(e)})") from None


def _read_saved(path: str, split: str | None, option: str, default: str | None) -> list[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"{path}: reading a directory written by save_to_disk needs the datasets package, which "
                        f"is not installed; install it with: pip install datasets") from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - not a saved dataset, or a damaged one
        raise UserError(f"{path}: not a dataset written by datasets' save_to_disk ({first_line(e)})") from None
    where = path
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        name = split if split is not None else names[0] if len(names) == 1 else default
        if name not in ds:
            raise UserError(f"{path}: no split {name!r} (its splits: {', '.join(names)}); choose one with "
                            f"env.options.{option}")
        ds, where = ds[name], f"{path} [{name}]"
    elif split is not None:
        raise UserError(f"{path}: a Dataset without splits; remove env.options.{option}")
    return [(f"{where}: row {i}", r) for i, r in enumerate(ds.to_list())]


def load_rows(path: str, options: DatasetOptions, split: str | None = None, split_option: str = "split",
              default_split: str | None = "train") -> list[Row]:
    """The checked rows of ``path`` (see :func:`read_records` for the arguments).

    Raises:
        UserError: ``<where>: <problem>`` for every bad row (at most ``MAX_REPORTED``, then a
            count), or one line for a file that cannot be read or has no rows.
    """
    check = answer_error(options.verifier)
    rows, errors = [], []
    for where, record in read_records(path, split, split_option, default_split):
        try:
            rows.append(_row(record, options, check))
        except _BadRow as e:
            errors.append(f"{where}: {e}")
    if len(errors) > MAX_REPORTED:
        errors = errors[:MAX_REPORTED] + [f"{path}: ... and {len(errors) - MAX_REPORTED} more bad rows"]
    if errors:
        raise UserError(*errors)
    if not rows:
        raise UserError(f"{path}: no rows (a row looks like {_example(options)})")
    return rows


def _row(record: Any, o: DatasetOptions, check) -> Row:
    if isinstance(record, _Unreadable):
        raise _BadRow(record.reason)
    if not isinstance(record, dict):
        raise _BadRow(f"a row must be an object like {_example(o)}, got {type(record).__name__}")
    prompt = _text(record, o.prompt_column, "prompt_column", o)
    answer = _text(record, o.answer_column, "answer_column", o, number=True)
    problem = check(answer)
    if problem:
        raise _BadRow(f"answer {answer!r} {problem} (verifier {o.verifier!r})")
    target = _text(record, o.demonstration_column, "demonstration_column", o) if o.demonstration_column else answer
    task = _text(record, o.task_column, "task_column", o) if o.task_column else "dataset"
    return Row(prompt, answer, target, task)


def _text(record: dict, column: str, option: str, o: DatasetOptions, number: bool = False) -> str:
    value = record.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise _BadRow(f"missing column {column!r}; a row looks like {_example(o)} (env.options.{option} "
                      f"names another column)")
    if number and isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        kind = "a string or a number" if number else "a string"
        text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise _BadRow(f"column {column!r} must be {kind}, got {text} (type {type(value).__name__})")
    if not value.strip():
        raise _BadRow(f"column {column!r} is empty" + ("; every row needs its reference answer" if number else ""))
    return value


def _example(o: DatasetOptions) -> str:
    row = {o.prompt_column: "What is 2 + 3?", o.answer_column: "5"}
    if o.demonstration_column:
        row[o.demonstration_column] = "2 + 3 = 5. The answer is 5"
    return json.dumps(row)


class DatasetRows:
    """The data of an env of this module: the checked training and held-out rows (read once, on
    first use), the training order, and the verifier that judges a response.

    Args:
        options: the env's validated options.
        seed: the training order is a function of it.
    """

    def __init__(self, options: DatasetOptions, seed: int):
        self.options, self.seed = options, seed
        self.verify: Verify = load_verifier(options.verifier, options.verifier_options)

    @cached_property
    def splits(self) -> tuple[list[Row], list[Row]]:
        """``(training rows, held-out rows)``."""
        o = self.options
        train = self._load("dataset", o.split, "split", "train")
        if o.eval_dataset is None and o.eval_split is None:
            train, evals = split_held_out(train, [r.prompt for r in train], o.eval_fraction, path=o.dataset,
                                          section="env.options", noun="prompts")
        else:
            evals = self._load("eval_dataset" if o.eval_dataset else "dataset", o.eval_split, "eval_split", None)
            train = self._without(train, {r.prompt for r in evals})
        return train, evals[:o.eval_size]

    def _load(self, option: str, split: str | None, split_option: str, default_split: str | None) -> list[Row]:
        """:func:`load_rows` of the file option ``option`` names, each line prefixed with its YAML path."""
        try:
            return load_rows(getattr(self.options, option), self.options, split, split_option, default_split)
        except UserError as e:
            raise UserError(*(f"env.options.{option}: {m}" for m in e.messages)) from None

    def _without(self, train: list[Row], held: set[str]) -> list[Row]:
        kept = [r for r in train if r.prompt not in held]
        if not kept:
            raise UserError(f"{self.options.dataset}: every training prompt is also a held-out prompt; give "
                            f"env.options.eval_dataset / eval_split other rows, or hold out env.options.eval_fraction")
        if len(kept) < len(train):
            logger.warning(f"env dataset: {len(train) - len(kept)} training rows of {self.options.dataset} have a "
                           f"held-out prompt; they are left out of training")
        return kept

    @cached_property
    def _order(self) -> EpochOrder:
        return EpochOrder(len(self.splits[0]), self.seed, "dataset")

    def train(self, start: int, n: int) -> list[tuple[int, Row]]:
        """``(position, row)`` of positions ``start .. start + n - 1`` of the training stream:
        epoch ``i // N`` is a seeded shuffle of the ``N`` training rows."""
        if start < 0 or n < 0:
            raise ValueError(f"dataset: train_prompts(start={start}, n={n}) needs both >= 0")
        rows = self.splits[0]
        return [(start + k, rows[j]) for k, j in enumerate(self._order.take(start, n))]

    def judge(self, prompt: Prompt, response: str) -> Score:
        """The verifier's reward for ``response`` to ``prompt``; right when it is at least 1.

        Raises:
            TypeError: when the verifier returns something other than a number (the reward
                source names the sample; ``fault_tolerance.reward_errors`` decides what follows).
        """
        if prompt.answer is None:
            raise ValueError(f"dataset: prompt {prompt.index} ({prompt.text[:60]!r}) has no answer to verify")
        value = self.verify(clean_response(response), prompt.answer)
        if not isinstance(value, numbers.Real):
            raise TypeError(f"verifier {self.options.verifier} returned {value!r} (a {type(value).__name__}); "
                            f"a verifier returns a float (1.0: right, 0.0: wrong)")
        reward = float(value)
        return Score(reward, correct=reward >= 1.0, info={"task": prompt.task})


@register_env("dataset")
class DatasetEnv(Env):
    """Prompts and answers from a dataset, scored by a verifier (module docstring)."""

    Config = DatasetOptions
    config: DatasetOptions

    def __init__(self, config: DatasetOptions | None = None, seed: int = 0):
        super().__init__(config, seed)
        self.rows = DatasetRows(self.config, seed)

    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        """Prompts ``start .. start + n - 1``: epoch ``i // N`` is a seeded shuffle of the rows."""
        return [_prompt(row, i) for i, row in self.rows.train(start, n)]

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts (``eval_dataset`` / ``eval_split``, or a hashed ``eval_fraction``)."""
        return [_prompt(row, i) for i, row in enumerate(self.rows.splits[1])]

    def score(self, prompts: list[Prompt], responses: list[str]) -> list[Score]:
        """The verifier's reward for each response; ``Score.correct`` when it is at least 1."""
        check_pairs(prompts, responses)
        return [self.rows.judge(p, r) for p, r in zip(prompts, responses)]

    def sft_examples(self, start: int, n: int) -> list[tuple[str, str]]:
        """``(prompt, demonstration or answer)`` of the training stream's positions ``start ..``."""
        return [(row.prompt, row.target) for _, row in self.rows.train(start, n)]

    def max_prompt_tokens(self, tokenizer, sample: int = 0) -> int:
        """The longest prompt of every row, training and held-out."""
        from xrlhf.data.text import encode_prompt

        train, evals = self.rows.splits
        return max(len(encode_prompt(tokenizer, t)) for t in {r.prompt for r in (*train, *evals)})


def _prompt(row: Row, index: int) -> Prompt:
    return Prompt(text=row.prompt, answer=row.answer, task=row.task, index=index)


class DatasetChatOptions(DatasetOptions, EpisodeOptions):
    """``env.options`` of ``dataset_chat``: those of ``dataset``, a system prompt, and the episode
    limits (one turn)."""

    system_prompt: str | None = Field(None, min_length=1, description="a system message before each prompt")
    max_turns: int = Field(1, ge=1, le=1, description="one answer per prompt")
    max_episode_tokens: int = Field(96, ge=1, description="tokens of the answer, its end-of-turn token included")


class _Answer(Episode):
    """One answer, judged by the verifier; the episode ends with it."""

    def __init__(self, rows: DatasetRows, prompt: Prompt):
        self.rows, self.prompt = rows, prompt

    def step(self, action: str) -> Turn:
        score = self.rows.judge(self.prompt, action)
        return Turn(reward=score.reward, done=True, correct=score.correct)


@register_env("dataset_chat")
class DatasetChatEnv(EpisodeEnv):
    """The ``dataset`` env's rows as chat messages, one turn each (module docstring)."""

    Config = DatasetChatOptions
    config: DatasetChatOptions

    def __init__(self, config: DatasetChatOptions | None = None, seed: int = 0):
        super().__init__(config, seed)
        self.rows = DatasetRows(self.config, seed)

    def _prompt(self, row: Row, index: int) -> Prompt:
        system = ({"role": "system", "content": self.config.system_prompt},) if self.config.system_prompt else ()
        return Prompt(text=row.prompt, answer=row.answer, task=row.task, index=index,
                      messages=(*system, {"role": "user", "content": row.prompt}))

    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        return [self._prompt(row, i) for i, row in self.rows.train(start, n)]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(row, i) for i, row in enumerate(self.rows.splits[1])]

    def start(self, prompt: Prompt) -> Episode:
        return _Answer(self.rows, prompt)

    def sft_conversations(self, start: int, n: int) -> list[list[Message]]:
        """The prompt's messages, then the demonstration (or the answer) as the assistant's turn."""
        return [[*self._prompt(row, i).messages, {"role": "assistant", "content": row.target}]
                for i, row in self.rows.train(start, n)]
