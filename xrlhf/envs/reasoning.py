"""``reasoning``: short arithmetic and logic problems with exactly checkable answers.

The environment every tutorial and CPU test trains on: the prompts are at most 16 characters
with the default options, so a 2-layer char-level model learns them in minutes, and the
reward is an exact match, so a rising reward means the policy really got better.

Task families (``{a}`` etc. drawn per prompt):

=========  =================  ==============  =================================
task       prompt             answer          well-formed (partial reward)
=========  =================  ==============  =================================
add        ``12+7=``          ``19``          digits
compare    ``12?7=``          ``>``           one of ``<``, ``>``, ``=``
sort       ``sort 3 1 2:``    ``1 2 3``       ``sort_length`` space-separated digits
parity     ``parity 1011:``   ``odd``         ``even`` or ``odd`` (parity of the 1s)
=========  =================  ==============  =================================

How the eval split stays disjoint from training: the problems of a task are numbered
``0 .. S-1`` (``add``/``compare``: ``a * (max_operand + 1) + b``; ``sort``: the digits read as
a number; ``parity``: the bits), a fixed pseudo-random permutation ``pi`` of ``[0, S)`` is
applied, and a problem is held out iff ``pi(number) < max(1, S // 8)``. Eval prompts are drawn
only from held-out problems and training prompts only from the others (by redrawing), so no
training prompt ever equals an eval prompt, however small the problem space. Because ``pi``
depends on the options but not on the seed, a problem held out in one run is held out in every
run with the same options. Both sides are never empty (every space has ``S >= 2``).

Prompt ``index`` of a split is drawn with ``random.Random(f"{seed}/{split}/{index}")``, and its
task is ``tasks[index % len(tasks)]``, so every task gets the same share of both splits.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Literal

from pydantic import Field, field_validator, model_validator

from xrlhf.envs.base import Env, EnvOptions, Prompt, Score, check_pairs, clean_response, register_env

TaskName = Literal["add", "compare", "sort", "parity"]

HOLDOUT_DIVISOR = 8
"""One problem in this many (at least one per task) belongs to the eval split."""


class ReasoningOptions(EnvOptions):
    """``env.options`` of the ``reasoning`` environment."""

    tasks: list[TaskName] = Field(default_factory=lambda: ["add", "compare", "sort", "parity"],
                                  description="task families, used in turn")
    max_operand: int = Field(20, ge=1, le=10**9, description="add/compare operands are 0..max_operand")
    sort_length: int = Field(3, ge=1, le=10, description="digits to sort")
    parity_length: int = Field(4, ge=1, le=32, description="bits of a parity problem")
    eval_size: int = Field(256, ge=1, description="prompts in the held-out split")
    reward_correct: float = Field(1.0, description="reward of an exactly right answer")
    reward_format: float = Field(0.0, description="reward of a well-formed wrong answer")

    @field_validator("tasks")
    @classmethod
    def _tasks_unique(cls, tasks: list[str]) -> list[str]:
        if not tasks:
            raise ValueError("choose at least one task of add, compare, sort, parity")
        repeated = sorted({t for t in tasks if tasks.count(t) > 1})
        if repeated:
            raise ValueError(f"task {', '.join(repeated)} is listed more than once")
        return tasks

    @model_validator(mode="after")
    def _format_below_correct(self) -> "ReasoningOptions":
        if self.reward_format > self.reward_correct:
            raise ValueError(f"reward_format ({self.reward_format}) exceeds reward_correct "
                             f"({self.reward_correct}); a wrong answer must not earn more than a "
                             f"right one, lower reward_format")
        return self


@dataclass(frozen=True)
class Task:
    """One task family over the problem numbers ``0 .. size(opts) - 1``.

    Attributes:
        size: the number of distinct problems.
        sample: draws a problem number (the task's own distribution over problems).
        render: problem number -> ``(prompt text, answer)``; one-to-one.
        well_formed: whether a (cleaned) response has the shape of an answer.
    """

    size: Callable[[ReasoningOptions], int]
    sample: Callable[[random.Random, ReasoningOptions], int]
    render: Callable[[int, ReasoningOptions], tuple[str, str]]
    well_formed: Callable[[str, ReasoningOptions], bool]


def _pairs(o: ReasoningOptions) -> int:
    return (o.max_operand + 1) ** 2


def _add_sample(rng: random.Random, o: ReasoningOptions) -> int:
    return rng.randrange(_pairs(o))


def _add_render(i: int, o: ReasoningOptions) -> tuple[str, str]:
    a, b = divmod(i, o.max_operand + 1)
    return f"{a}+{b}=", str(a + b)


def _compare_sample(rng: random.Random, o: ReasoningOptions) -> int:
    # The relation first, so "=" is a third of the problems rather than 1 / (max_operand + 1).
    relation = rng.choice("<>=")
    if relation == "=":
        a = b = rng.randrange(o.max_operand + 1)
    else:
        a, b = sorted(rng.sample(range(o.max_operand + 1), 2), reverse=relation == ">")
    return a * (o.max_operand + 1) + b


def _compare_render(i: int, o: ReasoningOptions) -> tuple[str, str]:
    a, b = divmod(i, o.max_operand + 1)
    return f"{a}?{b}=", "<" if a < b else ">" if a > b else "="


def _sort_render(i: int, o: ReasoningOptions) -> tuple[str, str]:
    digits = f"{i:0{o.sort_length}d}"
    return f"sort {' '.join(digits)}:", " ".join(sorted(digits))


def _parity_render(i: int, o: ReasoningOptions) -> tuple[str, str]:
    bits = f"{i:0{o.parity_length}b}"
    return f"parity {bits}:", "odd" if bits.count("1") % 2 else "even"


TASKS: dict[str, Task] = {
    "add": Task(_pairs, _add_sample, _add_render,
                lambda r, o: re.fullmatch(r"\d+", r) is not None),
    "compare": Task(_pairs, _compare_sample, _compare_render, lambda r, o: r in ("<", ">", "=")),
    "sort": Task(lambda o: 10**o.sort_length, lambda rng, o: rng.randrange(10**o.sort_length),
                 _sort_render, lambda r, o: re.fullmatch(rf"\d( \d){{{o.sort_length - 1}}}", r) is not None),
    "parity": Task(lambda o: 2**o.parity_length, lambda rng, o: rng.randrange(2**o.parity_length),
                   _parity_render, lambda r, o: r in ("even", "odd")),
}


def permute(i: int, size: int, key: int) -> int:
    """A fixed pseudo-random permutation of ``[0, size)`` evaluated at ``i``.

    Rounds of multiply-by-odd and xor-shift (each one-to-one on ``bits``-bit integers) permute
    ``[0, 2**bits)``; cycle-walking (re-applying them until the result is below ``size``)
    restricts that permutation to ``[0, size)``.
    """
    bits = max(1, (size - 1).bit_length())
    mask = (1 << bits) - 1
    x = i
    while True:
        for r in range(3):
            x = (x * 0x9E3779B97F4A7C15 + key + r) & mask
            x ^= x >> (bits // 2 + 1)
        if x < size:
            return x


def is_held_out(task: str, number: int, opts: ReasoningOptions) -> bool:
    """Whether problem ``number`` of ``task`` belongs to the eval split (see the module doc)."""
    size = TASKS[task].size(opts)
    return permute(number, size, zlib.crc32(task.encode())) < max(1, size // HOLDOUT_DIVISOR)


@register_env("reasoning")
class ReasoningEnv(Env):
    """Arithmetic, comparison, sorting and parity problems with exact-match rewards.

    A right answer earns ``reward_correct``, a well-formed wrong one ``reward_format``, anything
    else 0. ``Score.info`` holds ``task`` and ``well_formed``.
    """

    Config = ReasoningOptions
    config: ReasoningOptions

    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        """Prompts ``start .. start + n - 1`` of the training stream (never held out)."""
        if start < 0 or n < 0:
            raise ValueError(f"reasoning: train_prompts(start={start}, n={n}) needs both >= 0")
        return [self._prompt("train", i) for i in range(start, start + n)]

    def eval_prompts(self) -> list[Prompt]:
        """The ``eval_size`` held-out prompts (a copy of a list computed once)."""
        return list(self._eval)

    @cached_property
    def _eval(self) -> list[Prompt]:
        return [self._prompt("eval", i) for i in range(self.config.eval_size)]

    def _prompt(self, split: Literal["train", "eval"], index: int) -> Prompt:
        opts = self.config
        name = opts.tasks[index % len(opts.tasks)]
        task = TASKS[name]
        rng = random.Random(f"{self.seed}/{split}/{index}")
        number = task.sample(rng, opts)
        while is_held_out(name, number, opts) != (split == "eval"):
            number = task.sample(rng, opts)
        text, answer = task.render(number, opts)
        return Prompt(text=text, answer=answer, task=name, index=index)

    def max_prompt_tokens(self, tokenizer, sample: int = 64) -> int:
        """The longest of the widest problem of each task (largest operands, all digits) and of
        a sample of the prompts (a BPE may merge some numbers less well than the widest)."""
        from xrlhf.data.text import encode_prompt

        o = self.config
        widest = [TASKS[t].render(TASKS[t].size(o) - 1, o)[0] for t in o.tasks]
        return max(super().max_prompt_tokens(tokenizer, sample), *(len(encode_prompt(tokenizer, t)) for t in widest))

    def score(self, prompts: list[Prompt], responses: list[str]) -> list[Score]:
        """Exact match of the cleaned response against ``prompt.answer``."""
        check_pairs(prompts, responses)
        return [self._score_one(p, r) for p, r in zip(prompts, responses)]

    def _score_one(self, prompt: Prompt, response: str) -> Score:
        if prompt.task not in TASKS or prompt.answer is None:
            raise ValueError(f"reasoning: prompt {prompt.index} ({prompt.text!r}) has task "
                             f"{prompt.task!r} and answer {prompt.answer!r}; expected one of "
                             f"{', '.join(TASKS)} with an answer")
        text = clean_response(response)
        correct = text == prompt.answer
        formed = correct or TASKS[prompt.task].well_formed(text, self.config)
        reward = (self.config.reward_correct if correct
                  else self.config.reward_format if formed else 0.0)
        return Score(reward=reward, correct=correct, info={"task": prompt.task, "well_formed": formed})
