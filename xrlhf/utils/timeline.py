"""What ran when: spans of work on named lanes (trainer, generator, reward), for the run report.

Each step's row in ``metrics.jsonl`` carries the spans that ended during the step
(``timeline``: ``[lane, name, start_s, end_s]``, seconds since the run's timeline began), and
``xrlhf.report`` draws the last steps as a Gantt chart (``plots/timeline.png``): with an
asynchronous rollout the generator's bars overlap the trainer's. Thread-safe: the rollout
producer records from its own thread.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from loguru import logger


class Timeline:
    """Spans recorded by any thread; ``drain()`` hands them over once."""

    def __init__(self, origin: float | None = None):
        self.origin = time.time() if origin is None else origin
        self._spans: list[list] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, lane: str, name: str) -> Iterator[None]:
        """A span around the ``with`` block; its start is a DEBUG line of ``train.log`` (``trainer:
        update begins``), which tells a person (or ``benchmarks/recovery/chaos.py``) what a run is doing now."""
        logger.debug(f"{lane}: {name} begins")
        t0 = time.time()
        try:
            yield
        finally:
            self.add(lane, name, t0, time.time())

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        """A span by wall-clock times (``time.time()``)."""
        with self._lock:
            self._spans.append([lane, name, round(start - self.origin, 4), round(end - self.origin, 4)])

    def drain(self) -> list[list]:
        with self._lock:
            spans, self._spans = self._spans, []
        return spans


def process_start() -> float | None:
    """When this process started, in seconds since the epoch (Linux's /proc, to its clock tick);
    ``None`` where /proc does not tell."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
