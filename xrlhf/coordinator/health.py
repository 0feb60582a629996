"""Liveness of a run's workers, and the record of what was healed.

``Heartbeat`` pings every worker of every handle on a thread of the worker's own (the Ray
concurrency group ``health``), so a worker busy in a long train step still answers while a
frozen one (SIGSTOP, a hung process) does not. A worker that is dead, or has not answered a
ping for ``fault_tolerance.heartbeat_timeout_s``, is killed and reported as a
``WorkerDiedError`` naming its handle and rank; whoever waits on a handle polls ``check``
(``ModelHandle._get`` does, once a second), so no wait outlives a dead or frozen peer: a rank
blocked in a collective with a stopped peer is freed when the peer is killed.

What was healed is recorded in a ``utils.faults.Healing``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import ray
from loguru import logger
from ray.exceptions import RayActorError

from xrlhf.utils.errors import WorkerDiedError, first_line

HEALTH_GROUP = "health"
"""The concurrency group every worker answers pings in (one thread, beside its other calls)."""


class Heartbeat:
    """Pings the workers of ``handles()`` and raises for the first dead or frozen one.

    Args:
        handles: the run's handles by name (called at each check: healed handles' new workers count).
        timeout_s: a ping unanswered for this long means the worker is frozen.
        every_s: seconds between two rounds of pings (default: a fifth of the timeout, 0.5..5 s).
    """

    def __init__(self, handles: Callable[[], dict[str, Any]], timeout_s: float, every_s: float | None = None):
        self.handles, self.timeout_s = handles, timeout_s
        self.every_s = every_s if every_s is not None else min(5.0, max(0.5, timeout_s / 5))
        self._sent: dict[Any, tuple[ray.ObjectRef, float]] = {}  # actor id -> (ping, sent at)
        self._last = 0.0
        self._lock = threading.Lock()

    def check(self) -> None:
        """One round, at most every ``every_s``; raises ``WorkerDiedError`` for a dead or frozen worker."""
        now = time.monotonic()
        if now - self._last < self.every_s or not self._lock.acquire(blocking=False):
            return
        try:
            self._last = now
            live = set()
            for name, handle in list(self.handles().items()):
                for rank, worker in enumerate(list(handle.workers)):
                    key = worker  # an actor handle hashes and compares by its actor
                    live.add(key)
                    self._round(name, handle, rank, worker, key, now)
            for key in [k for k in self._sent if k not in live]:  # workers replaced since
                del self._sent[key]
        finally:
            self._lock.release()

    def find_dead(self, wait_s: float = 10.0) -> WorkerDiedError | None:
        """Ping every worker at once and wait up to ``wait_s``: the first dead one's error (its
        handle killed), or ``None`` when every worker that answered is alive."""
        pings = [(name, h, rank, w, w.ping.options(concurrency_group=HEALTH_GROUP).remote())
                 for name, h in list(self.handles().items()) for rank, w in enumerate(list(h.workers))]
        ray.wait([p[-1] for p in pings], num_returns=len(pings), timeout=wait_s)
        for name, handle, rank, worker, ref in pings:
            try:
                ray.get(ref, timeout=0)
            except RayActorError as e:
                handle.kill()
                return WorkerDiedError(f"{name} rank {rank} died: {first_line(e)}", name, rank, worker)
            except Exception:  # noqa: BLE001 - not answered yet: the regular checks decide about it
                continue
        return None

    def _round(self, name: str, handle: Any, rank: int, worker: Any, key: Any, now: float) -> None:
        sent = self._sent.get(key)
        if sent is None:
            self._sent[key] = (worker.ping.options(concurrency_group=HEALTH_GROUP).remote(), now)
            return
        ref, at = sent
        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            del self._sent[key]
            try:
                ray.get(ref)
            except RayActorError as e:
                handle.kill()  # its other ranks may wait for it in a collective
                raise WorkerDiedError(f"{name} rank {rank} died: {first_line(e)}", name, rank, worker) from None
        elif now - at > self.timeout_s:
            del self._sent[key]
            logger.warning(f"{name} rank {rank} has not answered a heartbeat for {now - at:.0f} s "
                           f"(fault_tolerance.heartbeat_timeout_s: {self.timeout_s:g}); killing it")
            handle.kill()
            raise WorkerDiedError(f"{name} rank {rank} stopped answering (no heartbeat for {now - at:.0f} s; "
                                  f"fault_tolerance.heartbeat_timeout_s: {self.timeout_s:g}); killed",
                                  name, rank, worker)
