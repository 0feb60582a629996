"""``EngineWorker``: the Ray actor that hosts one rank of a model handle.

The engines and every call on them are ``xrlhf.engines.host.EngineHost``'s (no Ray there, so
the in-process ``LocalHandle`` runs the very same code); this subclass adds what only a Ray
actor needs: the address of its node, where rank 0 hosts the torch.distributed rendezvous, and
a heartbeat and a quiet exit when Ray's SIGTERM lands in a garbage collector's callback.
"""

from __future__ import annotations

import time

MODULE_AT = time.time()
"""When this process began importing the worker's class (torch and the engines' host with it)."""

import gc  # noqa: E402 - after MODULE_AT, which times the imports below
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

import ray  # noqa: E402

from xrlhf.engines.base import DistInfo, EngineSpec  # noqa: E402
from xrlhf.engines.host import EngineHost  # noqa: E402
from xrlhf.utils.timeline import process_start  # noqa: E402
from xrlhf.utils.warnings_once import one_line_warnings  # noqa: E402

IMPORTED_AT = time.time()


class EngineWorker(EngineHost):
    """One rank of a handle. Created by ``ModelHandle`` as ``ray.remote(EngineWorker)``.

    Args:
        handle: the handle's name (for messages).
        rank: this worker's rank in the handle.
        threads: torch CPU threads for this worker.
        preload: the engines whose imports start at once (``EngineHost.preload``), if any.
    """

    def __init__(self, handle: str, rank: int, threads: int = 1,
                 preload: dict[str, tuple[str, EngineSpec]] | None = None):
        self._init_at = time.time()
        # What this process has loaded (Ray, torch) stays for its life: frozen, the collections that
        # the engines' imports trigger (transformers, vLLM: thousands of modules) do not walk it
        # again (docs/architecture.md). Here, not at import: only a
        # worker's process, never a driver that imports this module.
        gc.freeze()
        one_line_warnings()
        super().__init__(handle, rank, threads)
        sys.unraisablehook = sigterm_again_outside_callbacks
        if preload:
            # Here, not in a first call: a call waits for the driver to hear that the actor is up
            # (up to seconds on a loaded host), and vLLM's import is the generator's critical path.
            self.preload(preload)

    def setup(self, engines: dict[str, tuple[str, EngineSpec]], dist: DistInfo) -> dict[str, Any]:
        """``EngineHost.setup``, and in ``timeline`` when this process started (``born_at``),
        began and ended importing its class (``module_at``, ``imported_at``), was constructed
        (``init_at``) and began ``preload``'s imports (``called_at``: at the end of the constructor
        where it was given the engines, else the first call, ``EngineHost.preload``), in seconds
        since the epoch: where a worker's start-up went."""
        out = super().setup(engines, dist)
        out["timeline"] = {"born_at": process_start(), "module_at": MODULE_AT, "imported_at": IMPORTED_AT,
                           "init_at": self._init_at, "called_at": self._preload_at}
        return out

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
