"""Arithmetic word problems with worked answers: a local dataset for the ``dataset`` env.

Why: the ``dataset`` env reads GSM8K-shaped rows, and its configs, tests and tutorials need such
rows without a download. A row is::

    {"prompt": "Tom has 12 apples and buys 7 more. How many apples does he have now?",
     "answer": "19",
     "demonstration": "Tom has 12 apples and buys 7 more, so 12 + 7 = 19. The answer is 19",
     "task": "add"}

Task families (``TEMPLATES``): ``add``, ``subtract``, ``multiply`` and ``two_step`` (buy, then give
away), used in turn, with operands up to ``max_operand`` (a count someone starts with is at least
2). The demonstration is a worked answer that ends in the final number, so the ``numeric``
verifier accepts it (a supervised warm-up's target: ``env.options.demonstration_column``). Row ``i`` is drawn with
``random.Random(f"{seed}/arithmetic/{i}")``: the file is a function of its arguments, and a longer
file begins with the rows of a shorter one.

``xrlhf make-dataset arithmetic OUT.jsonl [--rows N] [--seed S] [--tasks add,subtract,multiply,two_step]
[--max-operand 20]`` is :func:`run` (the command's flags are :func:`xrlhf.envs.synthetic.add_arguments`).
"""

from __future__ import annotations

import argparse
import random
from typing import Any, Callable

from loguru import logger

from xrlhf.data.datasets import write_jsonl

PEOPLE = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Maria", "she"), ("Leo", "he"), ("Sara", "she"),
          ("Omar", "he"), ("Mia", "she"))
ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "coins", "shells")

Problem = tuple[str, int, str]
"""``(prompt, answer, demonstration)``."""


def _add(rng: random.Random, top: int) -> Problem:
    (name, he), item = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b = rng.randint(2, top), rng.randint(1, top)
    return (f"{name} has {a} {item} and buys {b} more. How many {item} does {he} have now?", a + b,
            f"{name} has {a} {item} and buys {b} more, so {a} + {b} = {a + b}.")


def _subtract(rng: random.Random, top: int) -> Problem:
    (name, _), (friend, _) = rng.sample(PEOPLE, 2)
    item = rng.choice(ITEMS)
    a = rng.randint(2, top)
    b = rng.randint(1, a - 1)
    return (f"{name} had {a} {item} and gave {b} to {friend}. How many {item} does {name} have left?", a - b,
            f"{name} had {a} {item} and gave away {b}, so {a} - {b} = {a - b}.")


def _multiply(rng: random.Random, top: int) -> Problem:
    (name, he), item = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b = rng.randint(2, top), rng.randint(2, top)
    return (f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {he} buy?", a * b,
            f"{a} bags of {b} {item} each make {a} * {b} = {a * b}.")


def _two_step(rng: random.Random, top: int) -> Problem:
    (name, he), (friend, _) = rng.sample(PEOPLE, 2)
    item = rng.choice(ITEMS)
    a, b = rng.randint(2, top), rng.randint(1, top)
    c = rng.randint(1, min(top, a + b - 1))
    return (f"{name} has {a} {item}, buys {b} more and then gives {c} to {friend}. How many {item} does {he} "
            f"have now?", a + b - c,
            f"{name} has {a} + {b} = {a + b} {item} after buying, then {a + b} - {c} = {a + b - c}.")


TEMPLATES: dict[str, Callable[[random.Random, int], Problem]] = {
    "add": _add, "subtract": _subtract, "multiply": _multiply, "two_step": _two_step}
"""Task family -> a problem drawn with operands ``1 .. top``."""


def option_errors(tasks: list[str], max_operand: int) -> dict[str, str]:
    """Option name (``tasks``, ``max_operand``) -> what is wrong with it; empty when both are fine."""
    errors = {}
    unknown = [t for t in tasks if t not in TEMPLATES]
    if unknown or not tasks:
        errors["tasks"] = f"unknown task {', '.join(unknown) or '(none given)'}; valid: {', '.join(TEMPLATES)}"
    if max_operand < 2:
        errors["max_operand"] = f"must be >= 2, got {max_operand}"
    return errors


def make_rows(rows: int, seed: int, tasks: list[str] | None = None, max_operand: int = 20) -> list[dict[str, Any]]:
    """``rows`` problems ``{prompt, answer, demonstration, task}``; task ``tasks[i % len(tasks)]``
    (default: every task family).

    Raises:
        ValueError: for the problems :func:`option_errors` finds.
    """
    tasks = list(TEMPLATES) if tasks is None else tasks
    errors = option_errors(tasks, max_operand)
    if errors:
        raise ValueError("; ".join(f"{k}: {v}" for k, v in errors.items()))
    out = []
    for i in range(rows):
        task = tasks[i % len(tasks)]
        prompt, answer, steps = TEMPLATES[task](random.Random(f"{seed}/arithmetic/{i}"), max_operand)
        out.append({"prompt": prompt, "answer": str(answer), "demonstration": f"{steps} The answer is {answer}",
                    "task": task})
    return out


def run(args: argparse.Namespace) -> int:
    """``xrlhf make-dataset arithmetic OUT``: write the rows ``args`` describe; returns 0.

    Raises:
        UserError: for bad flags, one line each naming the flag.
    """
    from xrlhf.utils.errors import UserError

    tasks = list(TEMPLATES) if args.tasks is None else [t.strip() for t in args.tasks.split(",") if t.strip()]
    errors = [f"make-dataset --{k.replace('_', '-')}: {v}" for k, v in option_errors(tasks, args.max_operand).items()]
    if args.split != "train":
        errors.append("make-dataset --split: arithmetic writes one file; the dataset env holds out "
                      "env.options.eval_fraction of its rows (by a hash of the prompt)")
    if errors:
        raise UserError(*errors)
    rows = make_rows(args.rows, args.seed, tasks, args.max_operand)
    path = write_jsonl(rows, args.out)
    logger.info(f"wrote {len(rows)} arithmetic word problems (tasks {','.join(tasks)}) to {path}")
    return 0
