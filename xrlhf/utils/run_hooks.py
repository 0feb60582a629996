"""The calls a run's parts make into the program that runs them, as one interface.

A trainer's steps and the coordinator's healing report to the shell around them (``xrlhf.runner``:
the tracker, checkpoints, transcripts, ``workers.json``) only through :class:`RunHooks`. Each hook
is a plain function and the defaults do nothing, so a test or a notebook that drives a trainer
passes only what it reads (``RunHooks(log=rows.append)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def _ignore(*_: Any) -> None:
    return None


def _go_on(step: int) -> bool:
    return False


def _no_step() -> int:
    return 0


@dataclass
class RunHooks:
    """What a run's trainer and coordinator tell the program around them.

    Attributes:
        log: a metrics row of a step or an evaluation (``{"step": N, ...}``).
        step_end: after step N (checkpoints, signals): ``True`` stops the training loop there.
        transcripts: an evaluation's episodes after step N, a few of them kept for reading
            (``None``: none kept, and the trainer does not collect them).
        workers: the run's worker process ids by handle, after the start and after each healing.
        running_step: the RL step under way (0 before the first), for the healing record.
    """

    log: Callable[[dict[str, Any]], None] = _ignore
    step_end: Callable[[int], bool] = _go_on
    transcripts: Callable[[int, list], None] | None = None
    workers: Callable[[dict[str, list[int]]], None] = _ignore
    running_step: Callable[[], int] = _no_step
