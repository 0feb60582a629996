"""The producer: a thread that builds the batches of every schedule, at most ``max_staleness``
versions ahead of the trainer.

Versions count published policy updates: version 0 is the start model, the update of step
``s`` (1-based) makes version ``s``; step ``s`` trains on batch ``s``. The trainer takes batch
``s`` (``get``), updates, and publishes version ``s`` (``before_sync``, the weight sync,
``after_sync``). With ``rollout.max_staleness`` ``k``:

* ``fixed`` freshness: batch ``b`` is generated entirely with version ``need(b) = max(0, b - 1 -
  k)``. The trainer syncs version ``s`` only once every batch that needs an older version is
  generated (``b <= s + k``), and the producer starts batch ``b`` only once ``need(b)`` is
  synced; what each batch holds is a function of the seed, never of timing. ``k = 0`` is the
  synchronous loop (batch ``s`` waits for version ``s - 1``: generate, train, sync, generate
  ...); ``k = 1`` is one-step-off (batch ``s + 1`` generates while step ``s`` trains).
* ``latest`` (``k >= 1``): batch ``b`` may start once version ``need(b)`` is *published* and
  uses whatever the generator holds then. Without ``in_flight_updates`` a sync waits for the
  generate calls under way; with them it lands mid-generation (the engine pauses at a token
  boundary) and each token records the version that sampled it. Timing-dependent.

Idle generator. When a batch is done and the next one cannot start before a sync (every batch
at ``k = 0``; the last batch always), the producer calls ``on_idle`` (the handles' ``end_rollout``: a co-located vLLM
frees its memory for the trainer) before it hands the batch over. An evaluation the trainer
runs on the generator meanwhile holds it awake (``hold`` / ``release``); the idle call then
runs when the hold is released.

Exact resume (``fixed``): ``state_dict(step)`` waits until batches ``step + 1 .. step + k`` are
queued and returns them with the producer's position; the batch under way then (version
``step``, the checkpointed weights) is regenerated on resume from its seeds.

A stopping run (``utils.bounded.STOPPING``, set a few seconds after a Ctrl-C) waits no longer:
``get`` and ``before_sync`` raise ``UserCodeAborted`` (the trainer abandons the step, or its
sync), and ``state_dict`` keeps the batches queued by then; the rest are generated again on
resume with the checkpoint's weights, a version newer than an uninterrupted run's (a resume
that is not bit for bit, said in a warning).

Faults: the thread's first exception is kept and raised in the trainer's thread by the next
``get`` / ``before_sync`` (and through ``utils.faults`` by a handle waiting on another model, so
a dead generator stops a long train step within about a second); no finished batch for
``rollout.stall_timeout_s`` raises ``WorkerDiedError`` naming the rollout.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from loguru import logger

from xrlhf.config.schema import RolloutConfig
from xrlhf.utils import faults
from xrlhf.utils.bounded import STOPPING, UserCodeAborted, describe_running
from xrlhf.utils.errors import UserError, WorkerDiedError

Collect = Callable[[int, int, Callable[[], None]], tuple[Any, int]]
"""``collect(batch, data_pos, on_generated) -> (rollout, next data_pos)``: generate and score
one batch from the data position; calls ``on_generated()`` once its last generate call is done
(scoring may still run). ``Collector`` is one."""


class Producer:
    """Generates batches ``start .. last`` in a thread (see the module docstring).

    Args:
        collect: builds one batch (``Collect``).
        options: the ``rollout`` section.
        last: the last batch to produce (``trainer.steps``).
        start: the first batch to produce (resume: after the restored queue).
        data_pos: the data position batch ``start`` begins at.
        synced: the version the generator holds now.
        queue: restored batches ``start - len(queue) .. start - 1``, by batch index.
        on_idle: called when the generator has nothing to do until the next sync; returns
            metrics of the batch just generated (``time/sleep_s``, memory by phase).
    """

    def __init__(self, collect: Collect, options: RolloutConfig, last: int, start: int = 1, data_pos: int = 0,
                 synced: int = 0, queue: dict[int, Any] | None = None,
                 on_idle: Callable[[], dict[str, float]] | None = None):
        self.collect, self.o, self.last, self.on_idle = collect, options, last, on_idle
        self.k = options.max_staleness
        self._next, self._pos, self._synced, self._published = start, data_pos, synced, synced
        self._generated = start - 1  # the last batch whose generation is done
        self._queue: dict[int, Any] = dict(queue or {})
        self._pos_after: dict[int, int] = {start - 1: data_pos}
        self._generating = False
        self._sync_pending = False
        self._holds = 0
        self._idle_pending: int | None = None  # the batch whose idle call waits for the release
        self._error: BaseException | None = None
        self._stopped = False
        self._progress = time.monotonic()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.waited_s = 0.0

    def need(self, batch: int) -> int:
        """The oldest version batch ``batch`` may be generated with."""
        return max(0, batch - 1 - self.k)

    # -- the thread -------------------------------------------------------------------------
    def start(self) -> "Producer":
        self._thread = threading.Thread(target=self._run, name="xrlhf-rollout", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop producing; a generate call under way finishes on its own (or dies with its workers),
        waited for ``timeout`` seconds at most (the thread is a daemon)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        faults.clear(self)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    b = self._next
                    if b > self.last:
                        return
                    self._cv.wait_for(lambda: self._stopped or self._may_start(b))
                    if self._stopped:
                        return
                    self._generating, self._idle_pending, pos = True, None, self._pos
                rollout, pos = self.collect(b, pos, lambda: self._mark_generated(b))
                self._mark_generated(b)
                self._idle(b, rollout)
                with self._cv:
                    self._queue[b], self._pos_after[b], self._pos = rollout, pos, pos
                    self._next = b + 1
                    self._progress = time.monotonic()
                    self._pos_after.pop(b - self.k - 2, None)
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread
            logger.debug(f"rollout producer stopped by {type(e).__name__}: {e}")
            with self._cv:
                self._error = e
                self._cv.notify_all()
            if not isinstance(e, UserCodeAborted):  # a stop is no failure: the trainer's calls finish
                faults.report(self, e)

    def _may_start(self, b: int) -> bool:
        if self.o.freshness == "fixed":
            return self._synced >= self.need(b)
        return self._published >= self.need(b) and not self._sync_pending

    def _idle(self, b: int, rollout: Any) -> None:
        """After batch ``b``: if the next batch waits for a sync, the generator is idle until then
        (its metrics join the batch's; deferred while the trainer holds the generator)."""
        with self._cv:
            idle = self.on_idle is not None and (b >= self.last or not self._may_start(b + 1))
            if idle and self._holds:  # an evaluation uses the generator: the last release does it
                self._idle_pending, idle = b, False
        metrics = self.on_idle() if idle else {}
        if hasattr(rollout, "metrics"):
            rollout.metrics.update({"time/sleep_s": 0.0, **metrics})

    def _mark_generated(self, b: int) -> None:
        with self._cv:
            if self._generating:
                self._generating = False
                self._generated = max(self._generated, b)
                self._progress = time.monotonic()
                self._cv.notify_all()

    # -- the trainer's side -----------------------------------------------------------------
    def get(self, batch: int) -> Any:
        """Batch ``batch``, waiting for it (the producer's error, if any, is raised here)."""
        t0 = time.monotonic()
        with self._cv:
            self._wait(lambda: batch in self._queue, f"batch {batch}")
            self.waited_s = time.monotonic() - t0
            return self._queue.pop(batch)

    def before_sync(self, version: int) -> float:
        """Version ``version`` is published; returns once it may be synced (seconds waited)."""
        t0 = time.monotonic()
        with self._cv:
            self._published = max(self._published, version)
            self._cv.notify_all()
            if self.o.freshness == "fixed":
                last = min(version + self.k, self.last)  # every batch that needs an older version
                self._wait(lambda: self._generated >= last, f"the generation of batch {last}")
            elif not self.o.in_flight_updates:
                self._sync_pending = True
                self._wait(lambda: not self._generating, "the generation under way")
        return time.monotonic() - t0

    def after_sync(self, version: int, hold: bool = False) -> None:
        """The generator now holds ``version``; ``hold``: the trainer will use it (an evaluation)
        before anything else may put it to sleep (``release`` when done)."""
        with self._cv:
            self._synced, self._sync_pending = version, False
            self._holds += int(hold)
            self._progress = time.monotonic()
            self._cv.notify_all()

    def release(self) -> None:
        """The trainer's use of the generator (``after_sync(hold=True)``) is over; an idle call
        deferred meanwhile runs now, in this thread."""
        with self._cv:
            if not self._holds:
                return
            self._holds -= 1
            b = self._idle_pending if self._holds == 0 else None
            if b is not None:
                self._idle_pending = None
        if b is None or self.on_idle is None:
            return
        metrics = self.on_idle()
        with self._cv:  # batch b waits in the queue (the trainer takes it after this)
            if hasattr(self._queue.get(b), "metrics"):
                self._queue[b].metrics.update(metrics)

    def state_dict(self, step: int) -> dict[str, Any]:
        """What resumes the producer after step ``step``: the queued batches ``step + 1 ..
        step + k`` (waited for) and the data position after them (``fixed`` freshness: the batch
        under way is regenerated from its seeds on resume). A stopping run keeps those queued
        by then (module docstring)."""
        last = min(step + self.k, self.last)
        with self._cv:
            try:
                self._wait(lambda: all(b in self._queue for b in range(step + 1, last + 1)), f"batch {last}")
            except UserCodeAborted:
                last, wanted = queued_through(self._queue, step), min(step + self.k, self.last)
                which = f"batch {wanted} was" if last + 1 == wanted else f"batches {last + 1}..{wanted} were"
                logger.warning(f"rollout: {which} not finished when the run stopped; a resume generates "
                               f"{'it' if last + 1 == wanted else 'them'} again with the weights of step {step} "
                               f"(not bit for bit the uninterrupted run)")
            queue = {b: self._queue[b] for b in range(step + 1, last + 1)}
            return {"next": last + 1, "data_pos": self._pos_after[last], "queue": queue}

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding the condition) until ``ready()``; raise the producer's error,
        ``UserCodeAborted`` once the run is stopping, or ``WorkerDiedError`` after
        ``stall_timeout_s`` without progress."""
        since = time.monotonic()
        while not ready():
            if self._error is not None:
                raise self._error
            if STOPPING.is_set():
                raise UserCodeAborted(f"rollout: waiting for {what}")
            if self._stopped:
                raise RuntimeError(f"rollout producer stopped while waiting for {what}")
            stalled = time.monotonic() - max(self._progress, since)
            if stalled > self.o.stall_timeout_s:
                culprit = describe_running(min_seconds=min(stalled, self.o.stall_timeout_s) / 2, waited=True)
                if culprit:  # user code holds the rollout up: restarting workers would not help
                    raise UserError(f"rollout: nothing generated for {stalled:.0f} s while waiting for {what}; "
                                    f"{culprit}")
                raise WorkerDiedError(f"rollout: nothing generated for {stalled:.0f} s while waiting for {what} "
                                      f"(rollout.stall_timeout_s = {self.o.stall_timeout_s:g})")
            self._cv.wait(timeout=min(POLL_S, self.o.stall_timeout_s))


POLL_S = 0.1
"""How often a wait looks at the clock (the stall timeout, a stopping run)."""


def queued_through(queue: dict[int, Any], step: int) -> int:
    """The last batch of the unbroken run ``step + 1, step + 2, ...`` in ``queue`` (``step``: none)."""
    last = step
    while last + 1 in queue:
        last += 1
    return last
