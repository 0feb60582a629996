"""``EngineWorker``: the Ray actor that hosts one rank of a model handle.

The engines and every call on them are ``xrlhf.engines.host.EngineHost``'s (no Ray there, so
the in-process ``LocalHandle`` runs the very same code); this subclass adds what only a Ray
actor needs: the address of its node, where rank 0 hosts the torch.distributed rendezvous, and
a heartbeat and a quiet exit when Ray's SIGTERM lands in a garbage collector's callback.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

import ray

from xrlhf.engines.host import EngineHost


class EngineWorker(EngineHost):
    """One rank of a handle. Created by ``ModelHandle`` as ``ray.remote(EngineWorker)``.

    Args:
        handle: the handle's name (for messages).
        rank: this worker's rank in the handle.
        threads: torch CPU threads for this worker.
    """

    def __init__(self, handle: str, rank: int, threads: int = 1):
        super().__init__(handle, rank, threads)
        sys.unraisablehook = sigterm_again_outside_callbacks

    def ping(self) -> int:
        """Liveness: answered on the ``health`` concurrency group's own thread, so a worker busy in a
        long call still answers (``coordinator.health.Heartbeat``); returns the process id."""
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (rank 0 hosts the torch.distributed rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port


def sigterm_again_outside_callbacks(unraisable) -> None:
    """``sys.unraisablehook`` of a worker. Ray stops a worker with SIGTERM, whose handler raises
    ``SystemExit``; when the signal lands in a weakref or ``__del__`` callback, Python cannot
    raise there: it prints "Exception ignored" with a traceback, and the worker runs on until
    Ray's SIGKILL. Seen in CI while a run healed. Here a thread sends the signal again a moment
    later, when the main thread is out of the callback, so the worker exits as Ray means it to
    (its ``finally`` blocks and atexit run), without the traceback. Any other unraisable
    exception goes to Python's own hook."""
    tb, names = unraisable.exc_traceback, set()
    while tb is not None:
        names.add(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if isinstance(unraisable.exc_value, SystemExit) and "sigterm_handler" in names:
        # Not from here: a signal sent by this thread is handled at once, still inside the callback.
        again = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
        again.daemon = True
        try:
            again.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown": exiting already
            pass
        return
    sys.__unraisablehook__(unraisable)
