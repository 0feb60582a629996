"""Small datasets for the offline algorithms, built from the ``reasoning`` environment.

The configs of DPO, offline KTO, reward-model training and the Q&A environment need data,
and nothing may be downloaded. Problems of the reasoning env have an exactly known right
answer, so a preference pair is ``chosen = the answer``, ``rejected = a plausible wrong
answer`` (well-formed, close to the right one: ``19`` vs ``18``, ``<`` vs ``>``, ``1 2 3`` vs
``2 1 3``), and a KTO row is one of the two with its label. Prompts of ``--split train`` come
from the env's training stream and those of ``--split eval`` from its held-out problems, so an
eval file never shares a problem with a training file or with the RL eval split's complement.

``xrlhf make-dataset {preferences,kto,qa} OUT.jsonl [--rows N] [--seed S] [--split train|eval]``
is :func:`add_arguments` + :func:`run`; ``make-dataset arithmetic`` (word problems with worked
answers, for the ``dataset`` env) is :mod:`xrlhf.envs.word_problems`. ``xrlhf prepare-data``
builds every dataset the shipped configs read, with the recipes of :data:`SHIPPED`: the one
place those recipes are written (the configs' comments and docs/algorithms.md point here).
"""

from __future__ import annotations

import argparse
import random
from typing import Any, Callable

from loguru import logger

from xrlhf.data.datasets import write_jsonl
from xrlhf.envs.base import Prompt
from xrlhf.envs.reasoning import ReasoningEnv, ReasoningOptions


def _wrong_add(p: Prompt, rng: random.Random, o: ReasoningOptions) -> str:
    right = int(p.answer)
    offsets = [d for d in (-3, -2, -1, 1, 2, 3, 10, -10) if right + d >= 0]
    return str(right + rng.choice(offsets))


def _wrong_compare(p: Prompt, rng: random.Random, o: ReasoningOptions) -> str:
    return rng.choice([s for s in "<>=" if s != p.answer])


def _wrong_sort(p: Prompt, rng: random.Random, o: ReasoningOptions) -> str:
    digits = p.answer.split()
    if len(set(digits)) > 1 and rng.random() < 0.5:
        while digits == sorted(digits):
            rng.shuffle(digits)
        return " ".join(digits)
    # a sorted list of the wrong digits: only checking the digits tells it apart
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    return " ".join(sorted(digits))


def _wrong_parity(p: Prompt, rng: random.Random, o: ReasoningOptions) -> str:
    return "even" if p.answer == "odd" else "odd"


WRONG: dict[str, Callable[[Prompt, random.Random, ReasoningOptions], str]] = {
    "add": _wrong_add, "compare": _wrong_compare, "sort": _wrong_sort, "parity": _wrong_parity}
"""Task -> a plausible wrong answer (well-formed, never equal to the right one)."""


def wrong_answer(prompt: Prompt, rng: random.Random, opts: ReasoningOptions) -> str:
    """A well-formed answer to ``prompt`` that is not ``prompt.answer``."""
    wrong = WRONG[prompt.task](prompt, rng, opts)
    assert wrong != prompt.answer, (prompt, wrong)
    return wrong


def source_prompts(opts: ReasoningOptions, rows: int, split: str, seed: int) -> list[Prompt]:
    """``rows`` prompts of the reasoning env's ``split`` (``train`` or ``eval``)."""
    if split == "eval":
        return ReasoningEnv(opts.model_copy(update={"eval_size": rows}), seed).eval_prompts()
    return ReasoningEnv(opts, seed).train_prompts(0, rows)


def make_rows(kind: str, prompts: list[Prompt], opts: ReasoningOptions, seed: int,
              desirable_fraction: float = 0.5) -> list[dict[str, Any]]:
    """Rows of ``kind`` (``preferences``, ``kto`` or ``qa``) for ``prompts``.

    ``kto`` rows are unpaired, as KTO's data usually is: each prompt appears once, with its
    right answer (label true) with probability ``desirable_fraction``, else a wrong one.
    """
    rng = random.Random(f"{seed}/{kind}")
    out = []
    for p in prompts:
        if kind == "preferences":
            out.append({"prompt": p.text, "chosen": p.answer, "rejected": wrong_answer(p, rng, opts)})
        elif kind == "kto":
            good = rng.random() < desirable_fraction
            out.append({"prompt": p.text, "completion": p.answer if good else wrong_answer(p, rng, opts),
                        "label": good})
        elif kind == "qa":
            out.append({"prompt": p.text, "answer": p.answer})
        else:
            raise ValueError(f"make-dataset: unknown kind {kind!r}; valid: preferences, kto, qa")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``xrlhf make-dataset KIND OUT``."""
    parser.add_argument("kind", choices=["preferences", "kto", "qa", "arithmetic"],
                        help="row format to write (arithmetic: word problems for the dataset env)")
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--rows", type=int, default=2000, help="number of rows (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="the dataset is a function of its arguments")
    parser.add_argument("--split", choices=["train", "eval"], default="train",
                        help="draw prompts from the env's training problems or its held-out ones")
    parser.add_argument("--tasks", default=None, help="comma-separated task families (default: all; "
                        "add,compare,sort,parity, or for arithmetic add,subtract,multiply,two_step)")
    parser.add_argument("--max-operand", type=int, default=20, help="add/compare operands are 0..N "
                        "(arithmetic: 1..N)")
    parser.add_argument("--desirable-fraction", type=float, default=0.5, help="kto: share of label-true rows")


def run(args: argparse.Namespace) -> int:
    """Write the dataset ``args`` describes; returns 0.

    Raises:
        UserError: for bad options, naming the flag.
    """
    from pydantic import ValidationError

    from xrlhf.utils.errors import UserError

    if args.rows < 1:
        raise UserError(f"make-dataset --rows: must be >= 1, got {args.rows}")
    if args.kind == "arithmetic":
        from xrlhf.envs import word_problems

        return word_problems.run(args)
    if not 0.0 <= args.desirable_fraction <= 1.0:
        raise UserError(f"make-dataset --desirable-fraction: must be in [0, 1], got {args.desirable_fraction}")
    try:
        tasks = args.tasks or "add,compare,sort,parity"
        opts = ReasoningOptions(tasks=[t.strip() for t in tasks.split(",") if t.strip()],
                                max_operand=args.max_operand)
    except ValidationError as e:
        raise UserError(*(f"make-dataset --{'-'.join(map(str, err['loc'])).replace('_', '-')}: {err['msg']}"
                          for err in e.errors(include_url=False))) from None
    prompts = source_prompts(opts, args.rows, args.split, args.seed)
    rows = make_rows(args.kind, prompts, opts, args.seed, args.desirable_fraction)
    path = write_jsonl(rows, args.out)
    logger.info(f"wrote {len(rows)} {args.kind} rows ({args.split} split, tasks {','.join(opts.tasks)}) to {path}")
    return 0


SHIPPED: dict[str, list[str]] = {
    "artifacts/data/preferences.jsonl": ["preferences", "--rows", "10000", "--seed", "1"],      # dpo, rm
    "artifacts/data/preferences_eval.jsonl": ["preferences", "--rows", "512", "--seed", "2", "--split", "eval"],  # rm
    "artifacts/data/kto.jsonl": ["kto", "--rows", "4000", "--seed", "3"],                       # kto_offline
    "artifacts/data/qa.jsonl": ["qa", "--rows", "4000", "--seed", "4"],                         # qa_ppo
    "artifacts/data/qa_eval.jsonl": ["qa", "--rows", "256", "--seed", "5", "--split", "eval"],  # qa_ppo
    "artifacts/data/arithmetic.jsonl": ["arithmetic", "--rows", "4000", "--seed", "6"],       # arithmetic
}
"""The datasets the shipped configs read -> ``xrlhf make-dataset`` arguments (those from the
reasoning env on tasks add, compare, sort with operands up to 20, as the configs' env sections:
:func:`recipe`)."""

SHIPPED_TASKS = ["--tasks", "add,compare,sort", "--max-operand", "20"]


def recipe(path: str) -> list[str]:
    """The ``xrlhf make-dataset`` arguments after ``KIND OUT`` that build the shipped dataset ``path``."""
    kind, *rest = SHIPPED[path]
    return rest if kind == "arithmetic" else [*rest, *SHIPPED_TASKS]


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``xrlhf prepare-data``."""
    parser.add_argument("--root", default=".", help="the directory the configs run from (default: here)")
    parser.add_argument("--force", action="store_true", help="rebuild files that exist")


def prepare(args: argparse.Namespace) -> int:
    """Build every dataset of :data:`SHIPPED` under ``args.root`` that is missing; returns 0."""
    from pathlib import Path

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for path in SHIPPED:
        out = Path(args.root) / path
        if out.is_file() and not args.force:
            logger.info(f"{out}: exists (--force rebuilds it)")
            continue
        run(parser.parse_args([SHIPPED[path][0], str(out), *recipe(path)]))
    return 0
