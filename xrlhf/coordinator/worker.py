"""``EngineWorker``: the Ray actor that hosts one rank of a model handle.

The engines and every call on them are ``xrlhf.engines.host.EngineHost``'s (no Ray there, so
the in-process ``LocalHandle`` runs the very same code); this subclass adds what only a Ray
actor needs: the address of its node, where rank 0 hosts the torch.distributed rendezvous, and
a heartbeat.
"""

from __future__ import annotations

import os
import socket

import ray

from xrlhf.engines.host import EngineHost


class EngineWorker(EngineHost):
    """One rank of a handle. Created by ``ModelHandle`` as ``ray.remote(EngineWorker)``.

    Args:
        handle: the handle's name (for messages).
        rank: this worker's rank in the handle.
        threads: torch CPU threads for this worker.
    """

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
