"""User code with a time limit: an env's step, a tool, a reward function that may never return.

Python cannot stop a thread, so :func:`call_bounded` runs the call in a *daemon* thread of its
own and waits for it at most ``timeout_s``: past that the caller gets :class:`UserCodeTimeout`
and goes on, and the call is abandoned (it may still be running; being a daemon thread it never
keeps the interpreter from exiting). A thread pool cannot do this: ``ThreadPoolExecutor``
threads are joined at exit, so one stuck call hangs Ctrl-C and the interpreter's shutdown
(issue 26). The wait also ends at once when ``cancel`` is set, or when the process's own
:data:`STOPPING` is (a stop request: ``runner.StopRequest`` sets it a few seconds after a first
Ctrl-C, at once after a second), with :class:`UserCodeAborted`.

:func:`running_calls` lists the bounded calls under way and for how long, abandoned ones
included: what a stall message names as the culprit.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")

POLL_S = 0.05
"""How often a wait looks at ``cancel`` and :data:`STOPPING`."""


class Cancel:
    """When waits give up: at once (:meth:`set`), from a moment on (:meth:`set_after`), or not
    (:meth:`clear`); read by :meth:`is_set`, like a ``threading.Event`` (either may be
    :func:`call_bounded`'s ``cancel``)."""

    def __init__(self):
        self._at: float | None = None  # time.monotonic() from which it is set

    def set(self) -> None:
        self.set_after(0.0)

    def set_after(self, seconds: float) -> None:
        """Set ``seconds`` from now (or earlier, if it was set to come sooner)."""
        at = time.monotonic() + seconds
        self._at = at if self._at is None else min(self._at, at)

    def clear(self) -> None:
        self._at = None

    def is_set(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at


STOPPING = Cancel()
"""Set while the run stops (``runner.StopRequest``): every bounded call, and the rollout's
waits for a batch (``rollout.producer``), give up and raise :class:`UserCodeAborted`."""


class UserCodeTimeout(Exception):
    """A bounded call ran past its limit and was abandoned.

    Attributes:
        what: the call, as the caller named it (``"env Calc: Episode.step (prompt '12*34=')"``).
        timeout_s: the limit it ran past.
    """

    def __init__(self, what: str, timeout_s: float):
        self.what, self.timeout_s = what, timeout_s
        super().__init__(f"{what}: no answer after {timeout_s:g} s (abandoned)")


class UserCodeAborted(Exception):
    """The wait for a bounded call (or for the rollout) was cancelled (``cancel`` or
    :data:`STOPPING` set); what it waited for was abandoned."""

    def __init__(self, what: str):
        self.what = what
        super().__init__(f"{what}: abandoned (the run is stopping)")


@dataclass
class RunningCall:
    """A bounded call under way: what it is, when it started, whether its caller gave up on it."""

    what: str
    started: float
    abandoned: bool = False

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


_running: dict[int, RunningCall] = {}
_ids = itertools.count()
_lock = threading.Lock()


def running_calls(min_seconds: float = 0.0, waited: bool = False) -> list[RunningCall]:
    """The bounded calls still running for at least ``min_seconds``, longest first: abandoned
    ones too, or with ``waited`` only those a caller still waits for."""
    with _lock:
        calls = [c for c in _running.values() if c.seconds >= min_seconds and not (waited and c.abandoned)]
    return sorted(calls, key=lambda c: c.started)


def describe_running(min_seconds: float = 0.0, limit: int = 3, waited: bool = False) -> str:
    """One line on the longest-running bounded calls (``""`` when none; ``waited``: only those a
    caller still waits for): for stall messages."""
    calls = running_calls(min_seconds, waited)
    if not calls:
        return ""
    parts = [f"{c.what} for {c.seconds:.0f} s" + (" (abandoned)" if c.abandoned else "") for c in calls[:limit]]
    more = f" and {len(calls) - limit} more" if len(calls) > limit else ""
    return "user code still running: " + "; ".join(parts) + more


def call_bounded(fn: Callable[[], T], timeout_s: float | None, what: str,
                 cancel: threading.Event | Cancel | None = None) -> T:
    """``fn()``, or :class:`UserCodeTimeout` once it has run ``timeout_s`` seconds.

    ``fn`` runs in a new daemon thread; its result is returned and its exception (any
    ``BaseException``) re-raised here. On a timeout or a cancel the thread is abandoned, not
    stopped: whatever ``fn`` does goes on in the background until it returns (its result is
    dropped), and it is listed by :func:`running_calls` meanwhile.

    Args:
        fn: the call, without arguments (wrap it in a lambda).
        timeout_s: the limit in seconds; ``None``: no limit (still abortable by ``cancel``).
        what: the call named for messages: the component and the input (env, tool, prompt).
        cancel: when set, stop waiting at once and raise :class:`UserCodeAborted` (so does
            :data:`STOPPING`).

    Raises:
        UserCodeTimeout: ``fn`` did not return within ``timeout_s``.
        UserCodeAborted: ``cancel`` or :data:`STOPPING` was set first.
    """
    done = threading.Event()
    box: dict[str, object] = {}
    key = next(_ids)
    call = RunningCall(what, time.monotonic())

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
            box["error"] = e
        finally:
            with _lock:
                _running.pop(key, None)
            done.set()

    with _lock:
        _running[key] = call
    threading.Thread(target=target, name=f"bounded: {what[:60]}", daemon=True).start()
    deadline = None if timeout_s is None else call.started + timeout_s
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0 and not done.is_set():
            call.abandoned = True
            raise UserCodeTimeout(what, timeout_s)
        left = POLL_S if left is None else min(left, POLL_S)  # poll the cancels
        if done.wait(max(left, 0)):
            break
        if STOPPING.is_set() or (cancel is not None and cancel.is_set()):
            call.abandoned = True
            raise UserCodeAborted(what)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
