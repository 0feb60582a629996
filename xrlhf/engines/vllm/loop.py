"""The vLLM engine's request loop: keyed ``generate`` calls from many threads, streamed through
one thread, with weights that may land while they generate (partial rollout).

Why a loop of our own: ``LLM.generate`` steps the engine until every request it knows has
finished, so two calls from two threads would step each other's requests, and vLLM's engine
client is not thread-safe. A keyed call (``seeds`` given) queues its rows here; one loop thread
adds them, calls ``step()``, collects each step's outputs as deltas (so it knows which weights
sampled each token) and completes a call when its last row finishes.

One thread at a time owns the ``LLM``: the loop while it has requests in vLLM; any other use
waits in ``exclusive()`` until the loop is idle. A weight sync does not wait: ``begin_sync``
pauses the loop between two steps (``llm.sleep(level=0, mode="keep")``, nothing freed),
``finish_sync`` hands the ``LLM`` back, and each running call's ``on_update`` (``continue``,
``recompute``, ``abort``) decides what its rows do with the new weights. Requests carry a cache
salt that changes with every sync, so no new request reuses blocks the old weights computed. The
protocol step by step, with vLLM's file:line: docs/vllm.md ("Keyed generation").

vLLM is imported inside the functions that need it: ``xrlhf.engines.vllm`` imports this module
and must import without vLLM.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from xrlhf.internals.vllm import can_pause, outputs_pending
from xrlhf.utils.seeds import derive_seed

ON_UPDATE = ("continue", "recompute", "abort")


def sampled_logprobs(flat, ids: list[int]) -> list[float]:
    """The logprob of each sampled token from vLLM's ``FlatLogprobs`` (asked with ``logprobs=0``:
    one entry per position, the sampled token's). ``flat_logprobs`` keeps three flat lists per
    request instead of a dict and a ``Logprob`` per token, which vLLM's output processing and
    Python's garbage collector pay for at every step (docs/vllm.md, benchmarks/generation.py overhead).
    A DELTA output carries the slice of its new positions, re-indexed from 0."""
    starts = flat.start_indices
    if len(starts) != len(ids) or any(flat.token_ids[s] != t for s, t in zip(starts, ids)):
        raise RuntimeError(f"vLLM returned logprobs for {len(starts)} positions that do not match the "
                           f"{len(ids)} sampled tokens")
    return [float(flat.logprobs[s]) for s in starts]


@dataclass
class Row:
    """One prompt of a call and what has been sampled for it so far."""

    prompt: list[int]
    seed: int
    attempt: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class Call:
    """One keyed ``generate`` call.

    Attributes:
        params: seed -> the ``vllm.SamplingParams`` of a row (DELTA outputs).
        on_update: ``SamplingParams.on_update`` of the call.
        logprobs: where the rows' logprobs come from: ``"outputs"`` (vLLM's, step by step),
            ``"worker"`` (taken from vLLM's worker once the call has finished, ``internals/vllm_record.py``), or
            ``None`` (not asked for).
        left: rows not finished yet.
    """

    id: int
    rows: list[Row]
    params: Callable[[int], Any]
    on_update: str
    logprobs: str | None = "outputs"
    left: int = 0
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def request_id(self, row: int) -> str:
        return f"xrlhf-{self.id}-{row}-{self.rows[row].attempt}"


class RequestLoop:
    """The thread that streams keyed calls through ``llm.llm_engine``, and the ownership of the
    ``LLM`` between it and every other user (module docstring).

    Args:
        llm: the ``vllm.LLM``.
        version: the engine's current policy version (stamped on each token collected).
        prepare: called by the loop, owning the ``LLM``, before it adds a call's requests, with
            whether vLLM is idle (wake memory, reset the prefix cache); what it raises fails
            that call only.
        lora: the ``LoRARequest`` new requests carry (the policy's synced adapter), or ``None``.
        take: for calls whose logprobs stay in vLLM's worker: ``take(request ids, token ids of
            each, ids to drop)`` returns each request's logprobs (called by the loop, owning the ``LLM``).
    """

    def __init__(self, llm, version: Callable[[], int], prepare: Callable[[bool], None],
                 lora: Callable[[], Any] = lambda: None,
                 take: Callable[[list[str], list[list[int]], list[str]], list[list[float]]] | None = None):
        self.llm = llm
        self._version = version
        self._prepare = prepare
        self._lora = lora
        self._take = take
        self._stale: list[str] = []  # requests whose worker-side logprobs will never be taken
        self._cv = threading.Condition()
        self._owner: int | None = None  # thread id of whoever may touch the LLM
        self._waiting = 0  # threads waiting to own it: the loop admits no new calls meanwhile
        self._pending: deque[Call] = deque()
        self._running: dict[str, tuple[Call, int]] = {}  # request id -> (call, row); the loop's own
        self._pause: str | None = None  # None | "asked" | "parked" | "resume"
        self._pause_by: int | None = None
        self._sync_by: int | None = None  # the thread that began the sync: one thread may begin it, another end it
        self._resume_error: BaseException | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._tid: int | None = None
        self._ids = itertools.count()
        self.can_pause = can_pause(llm)
        self.epoch = 0
        """Syncs finished; the cache salt of new requests."""
        self.tokens_collected = 0
        """Tokens collected since the loop started (progress, for tests and logs)."""

    # -- calls --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], seeds: list[int], params: Callable[[int], Any],
                 on_update: str = "continue", logprobs: str | None = "outputs") -> Call:
        """Run one keyed call through the loop and wait for it; returns the finished ``Call``
        (its rows hold the tokens, logprobs and versions; ``logprobs``: see ``Call``). Raises
        what failed the call."""
        if on_update not in ON_UPDATE:
            raise ValueError(f"on_update must be one of {ON_UPDATE}, got {on_update!r}")
        if logprobs == "worker" and self._take is None:
            raise ValueError("this request loop cannot take logprobs from vLLM's worker")
        rows = [Row([int(t) for t in p], int(s)) for p, s in zip(prompts, seeds, strict=True)]
        call = Call(next(self._ids), rows, params, on_update, logprobs, left=len(rows))
        if not rows:
            return call
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"vLLM's request loop stopped after an error: {self._error!r}") from self._error
            if self._stopping:
                raise RuntimeError("the vLLM engine was shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="xrlhf-vllm-loop", daemon=True)
                self._thread.start()
                self._tid = self._thread.ident
            self._pending.append(call)
            self._cv.notify_all()
        call.finished.wait()
        if call.error is not None:
            raise call.error
        return call

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Own the ``LLM`` for the block (reentrant): waits until the loop has nothing in vLLM."""
        me = threading.get_ident()
        with self._cv:
            taken = self._owner != me
            if taken:
                self._waiting += 1
                try:
                    while self._owner is not None:
                        self._cv.wait()
                finally:
                    self._waiting -= 1
                self._owner = me
        try:
            yield
        finally:
            if taken:
                with self._cv:
                    self._owner = None
                    self._cv.notify_all()

    # -- weight syncs -------------------------------------------------------------------------
    def begin_sync(self) -> bool:
        """Own the ``LLM`` for a weight sync: at once if the loop is idle, else by pausing it
        mid-generation (its requests kept). Returns whether it paused the loop; ``finish_sync``
        ends the sync either way."""
        me = threading.get_ident()
        with self._cv:
            self._sync_by = me
            if self._owner == me:
                return self._pause == "parked"
            self._waiting += 1
            try:
                while True:
                    if self._owner is None:
                        self._owner = me
                        return False
                    if self._pause == "parked" and self._owner == me:
                        return True
                    if self._owner == self._tid and self._pause is None and self.can_pause:
                        self._pause, self._pause_by = "asked", me
                        self._cv.notify_all()
                    self._cv.wait()
            finally:
                self._waiting -= 1

    def finish_sync(self, paused: bool, error: BaseException | None = None) -> None:
        """End a sync, from any thread (a broadcast's receiver thread may have begun it): new
        requests get a new cache salt; a paused loop applies ``on_update`` and resumes (or, when
        ``error`` says the weights did not all load, fails its running calls)."""
        with self._cv:
            self.epoch += 1
            if paused and not self._stopping:  # straight back to the loop: nobody else may take the LLM in between
                self._pause, self._resume_error, self._owner = "resume", error, self._tid
            elif self._owner == self._sync_by:  # the sync's own hold (not a paused loop's)
                self._owner = None
            self._sync_by = None
            self._cv.notify_all()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the loop (calls still running fail) and join its thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        error = None
        try:
            while (work := self._next_work()) is not None:
                if work == "pause":
                    self._park()
                    continue
                self._add(work)
                if self._running:
                    self._collect(self._step())
        except BaseException as e:  # noqa: BLE001 - every waiting call must hear of it
            error = e
        self._close(error)

    def _next_work(self) -> list[Call] | str | None:
        """What the loop does next: calls to add (maybe none) and a step, ``"pause"``, or ``None``
        to stop. Waits while there is nothing to do; gives the ``LLM`` up when idle."""
        with self._cv:
            me = self._tid
            while True:
                if self._stopping:
                    return None
                if self._pause == "asked":
                    if self._running:
                        return "pause"
                    self._pause = None  # nothing in vLLM: the sync takes the LLM as it is
                    self._give_up()
                if self._pending and not self._waiting and self._owner in (None, me):
                    self._owner = me
                    calls = list(self._pending)
                    self._pending.clear()
                    return calls
                if self._owner == me and self._running:
                    return []
                self._give_up()
                self._cv.wait()

    def _give_up(self) -> None:
        if self._owner == self._tid:
            self._owner = None
            self._cv.notify_all()

    def _add(self, calls: list[Call]) -> None:
        """Put each call's rows into vLLM; a call that cannot start fails alone."""
        for call in calls:
            try:
                self._prepare(not self._running)
                for i in range(len(call.rows)):
                    self._submit(call, i)
            except Exception as e:  # noqa: BLE001 - the caller's error (a bad prompt, no weights)
                self._fail(call, e)

    def _submit(self, call: Call, i: int) -> None:
        from vllm.inputs import tokens_input

        row, rid = call.rows[i], call.request_id(i)
        prompt = tokens_input(row.prompt, cache_salt=f"xrlhf-{self.epoch}")
        lora = self._lora()
        self.llm.llm_engine.add_request(rid, prompt, call.params(derive_seed(row.seed, row.attempt)),
                                        **({} if lora is None else {"lora_request": lora}))
        self._running[rid] = (call, i)

    def _step(self) -> list:
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():  # step() would wait forever for outputs
            raise RuntimeError(f"vLLM has no unfinished requests but {len(self._running)} of ours did not finish")
        return engine.step()

    def _collect(self, outputs: list) -> None:
        """File a step's DELTA outputs under their rows, each token stamped with the current version."""
        version = self._version()
        for out in outputs:
            entry = self._running.get(out.request_id)
            if entry is None:
                continue  # not ours, or a row restarted meanwhile
            call, i = entry
            row, completion = call.rows[i], out.outputs[0]
            ids = [int(t) for t in completion.token_ids]
            if ids:  # a delta without tokens carries every position's logprobs (output_processor.py:394)
                if call.logprobs == "outputs":
                    row.logprobs += sampled_logprobs(completion.logprobs, ids)
                row.token_ids += ids
                row.versions += [version] * len(ids)
                self.tokens_collected += len(ids)
            if not out.finished:
                continue
            if completion.finish_reason in ("abort", "error"):
                self._fail(call, RuntimeError(f"vLLM ended request {out.request_id} ({completion.finish_reason})"))
                continue
            del self._running[out.request_id]
            call.left -= 1
            if call.left == 0:
                self._complete(call)

    def _complete(self, call: Call) -> None:
        """The call's last row finished: its logprobs from vLLM's worker if they stayed there."""
        if call.logprobs == "worker":
            try:
                stale, self._stale = self._stale, []
                lps = self._take([call.request_id(i) for i in range(len(call.rows))],
                                 [r.token_ids for r in call.rows], stale)
                for row, lp in zip(call.rows, lps, strict=True):
                    row.logprobs = lp
            except Exception as e:  # noqa: BLE001 - the call's failure, not the loop's
                call.error = e
        call.finished.set()

    def _fail(self, call: Call, error: BaseException) -> None:
        ids = [rid for rid, (c, _) in self._running.items() if c is call]
        for rid in ids:
            del self._running[rid]
        if ids:
            self.llm.llm_engine.abort_request(ids)
        if call.logprobs == "worker":
            self._stale += [call.request_id(i) for i in range(len(call.rows))]
        call.error = error
        call.finished.set()

    def _park(self) -> None:
        """Pause vLLM with its requests kept, collect what it sampled before the pause, hand the
        ``LLM`` to the syncing thread and wait for it back; then apply the update and resume."""
        self.llm.sleep(level=0, mode="keep")
        while outputs_pending(self.llm):
            self._collect(self.llm.llm_engine.step())
        with self._cv:
            self._pause, self._owner = "parked", self._pause_by
            self._cv.notify_all()
            while self._pause == "parked" and not self._stopping:
                self._cv.wait()
            if self._pause == "parked":
                return  # shut down while parked: vLLM's own shutdown ends its requests
            self._pause, error, self._resume_error = None, self._resume_error, None
        self._apply_update(error)
        self.llm.wake_up(tags=["scheduling"])

    def _apply_update(self, error: BaseException | None) -> None:
        """After new weights (still paused): each running call's ``on_update``; after a failed
        sync, fail the running calls (their rows would go on with half-loaded weights)."""
        if error is not None:
            for call in {id(c): c for c, _ in self._running.values()}.values():
                failure = RuntimeError(f"a weight sync failed while this call was generating: {error}")
                failure.__cause__ = error
                self._fail(call, failure)
            return
        restart = [(rid, call, i) for rid, (call, i) in self._running.items() if call.on_update == "abort"]
        if restart:
            self.llm.llm_engine.abort_request([rid for rid, _, _ in restart])
            for rid, call, i in restart:
                del self._running[rid]
                if call.logprobs == "worker":
                    self._stale.append(rid)
                row = call.rows[i]
                row.attempt += 1
                row.token_ids, row.logprobs, row.versions = [], [], []
                self._submit(call, i)
        if any(call.on_update == "recompute" for call, _ in self._running.values()):
            self.llm.reset_prefix_cache(reset_running_requests=True)

    def _close(self, error: BaseException | None) -> None:
        """The loop ends (``stop``, or ``error``): every call still waiting fails, none hangs. After
        an error our requests are aborted if vLLM still answers (``LLM.generate`` would collect
        them, and sorts what it collects by integer request id)."""
        if error is not None and self._running and self._owner == self._tid:
            try:
                self.llm.llm_engine.abort_request(list(self._running))
            except Exception:  # noqa: BLE001 - vLLM itself may be what failed
                pass
        with self._cv:
            if error is not None:
                self._error = error
            calls = {id(c): c for c, _ in self._running.values()}
            calls.update({id(c): c for c in self._pending})
            self._running.clear()
            self._pending.clear()
            self._give_up()
            if self._pause == "asked":
                self._pause = None
            self._cv.notify_all()
        for call in calls.values():
            if error is None:
                call.error = RuntimeError("the vLLM engine was shut down while this call was generating")
            else:
                call.error = RuntimeError(f"vLLM's request loop failed: {type(error).__name__}: {error}")
                call.error.__cause__ = error
            call.finished.set()
