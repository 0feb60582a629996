"""Failures of background work that the main thread must hear about while it waits elsewhere.

The asynchronous rollout's producer thread generates through one model while the trainer's
thread waits on another (a long train step). When the producer fails (its generator died),
``report`` records the error; ``check`` raises it in whichever thread calls it next. Handles
call ``check`` while they wait for their workers (``coordinator.ModelHandle._get`` polls in
slices of a second), so the trainer stops within about a second instead of finishing its step
first. No Ray here: a leaf of the layer graph.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_errors: dict[int, tuple[threading.Thread, BaseException]] = {}


def report(owner: object, error: BaseException) -> None:
    """Record ``owner``'s failure (its first one); raised by ``check`` in other threads."""
    with _lock:
        _errors.setdefault(id(owner), (threading.current_thread(), error))


def clear(owner: object) -> None:
    """Forget ``owner``'s failure (it was stopped and its error handled)."""
    with _lock:
        _errors.pop(id(owner), None)


def check() -> None:
    """Raise the first recorded failure of background work started by another thread."""
    with _lock:
        for thread, error in _errors.values():
            if thread is not threading.current_thread():
                raise error
