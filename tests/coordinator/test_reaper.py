"""What a killed worker started dies with it: vLLM's engine process and its tensor-parallel
workers hold GPU memory that the generator restarted in place needs (``Coordinator.heal``).
Ray 2.60 reaps a SIGKILLed worker's descendants, grandchildren too, within ~2 s (its docs
promise that only with the option ``kill_child_processes_on_worker_exit_with_raylet_subreaper``;
xrlhf does not set it: with it on, a run that failed with exit status 2 exited 0). This test
holds Ray to it; on a GPU no vLLM engine process outlived its killed worker (docs/healing.md)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(num_cpus=0)
class Spawner:
    def start(self) -> tuple[int, int]:
        """A shell (child) that starts ``sleep`` (grandchild); returns (own pid, grandchild pid)."""
        import subprocess

        sh = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        return os.getpid(), int(sh.stdout.readline())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_sigkilled_workers_grandchild_is_reaped():
    worker, grandchild = ray.get(Spawner.remote().start.remote())
    assert _alive(grandchild)
    os.kill(worker, signal.SIGKILL)
    deadline = time.time() + 15  # Ray: "within 10 seconds after the worker death"
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.2)
    alive = _alive(grandchild)
    if alive:
        os.kill(grandchild, signal.SIGKILL)
    assert not alive, "a SIGKILLed worker's grandchild outlived it"
