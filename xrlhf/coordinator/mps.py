"""NVIDIA MPS for one GPU shared by a trainer and an awake generator (``ray.mps``).

Why: processes that share a GPU each have a CUDA context of their own, and the GPU runs one
context at a time (time slices), so a one-step-off run on one GPU (vLLM generating batch s+1
while the trainer updates on batch s) overlaps only the host's idle time. Under MPS the
processes' kernels run side by side. W on one H100 (docs/async.md, same call): synchronous 5.11 s
per step; one step off 4.53 s without MPS, 3.85 s with it (1.33x the synchronous step).

This runs a control daemon of the run's own (``nvidia-cuda-mps-control -d``) with a pipe and a
log directory of its own, so only this run's processes are its clients: no setting of the GPU
is changed (its compute mode stays as found) and other programs on the machine never see it.
The local Ray's processes inherit ``CUDA_MPS_PIPE_DIRECTORY``; the daemon quits when Ray stops.
A daemon the environment already names (``CUDA_MPS_PIPE_DIRECTORY`` set) is used as it is.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from loguru import logger

from xrlhf.coordinator.spec import Topology, anchor_of

CONTROL = "nvidia-cuda-mps-control"


def overlaps_on_a_gpu(topology: Topology) -> bool:
    """Whether the rollout generates on a GPU it shares with the policy's trainer while that
    trains: one step off (``max_staleness >= 1``), the generator co-located with the policy and
    awake (a vLLM ``sleep_level`` of 0: one that sleeps through the update overlaps nothing)."""
    rollout, policy = topology.spec("rollout"), topology.spec("policy")
    if topology.max_staleness < 1 or rollout is None or policy is None:
        return False
    if any(getattr(spec.options, "sleep_level", 0) for _, spec in rollout.engines.values()):
        return False
    if rollout.resources.gpus_per_rank <= 0 and policy.resources.gpus_per_rank <= 0:
        return False
    specs = {s.name: s.resources for s in topology.handles}
    return anchor_of("rollout", specs) == anchor_of("policy", specs)


def wanted(topology: Topology) -> bool:
    """``ray.mps`` resolved: ``true``; ``auto`` where the rollout overlaps the trainer on a GPU of a
    local Ray and NVIDIA's control binary is installed; ``false``. (A joined cluster's nodes run
    the daemons their operators start: never this run's.)"""
    mode = topology.ray.mps
    if mode is False or topology.ray.address:
        return False
    if mode is True:
        return True
    return overlaps_on_a_gpu(topology) and shutil.which(CONTROL) is not None


class Daemon:
    """This run's MPS control daemon: ``start`` returns the variables its clients need."""

    def __init__(self):
        self.root: Path | None = None
        self.env: dict[str, str] = {}

    def start(self) -> dict[str, str]:
        """Start the daemon (a few ms); the clients' environment. A daemon already named by the
        environment is used, not started."""
        if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            logger.info(f"MPS: the daemon of CUDA_MPS_PIPE_DIRECTORY={os.environ['CUDA_MPS_PIPE_DIRECTORY']} "
                        "(not started by this run)")
            return {}
        binary = shutil.which(CONTROL)
        if binary is None:
            from xrlhf.utils.errors import UserError

            raise UserError(f"ray.mps: true needs NVIDIA's {CONTROL} on PATH (part of the NVIDIA driver's "
                            "utilities); install it, or set ray.mps=auto to run without MPS where it is missing")
        # short: the pipe directory holds a Unix socket, whose path may not exceed 107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="xrlhf-mps-"))
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}
        for d in self.env.values():
            os.makedirs(d)
        done = subprocess.run([binary, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=30, check=False)
        if done.returncode != 0:
            self._remove()
            raise RuntimeError(f"MPS: {CONTROL} -d failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
        atexit.register(self.stop)
        logger.info(f"MPS: a control daemon of this run's own ({self.env['CUDA_MPS_PIPE_DIRECTORY']}): the "
                    "trainer's and the generator's kernels run side by side on the GPU (ray.mps)")
        return dict(self.env)

    def stop(self) -> None:
        """Quit the daemon (after its clients, Ray's workers, have exited) and remove its directories."""
        if self.root is None:
            return
        binary = shutil.which(CONTROL)
        if binary is not None:
            try:
                subprocess.run([binary], input="quit\n", env={**os.environ, **self.env}, capture_output=True,
                               text=True, timeout=30, check=False)
            except (OSError, subprocess.TimeoutExpired) as e:
                logger.warning(f"MPS: the daemon of {self.root} did not quit ({e}); `echo quit | {CONTROL}` with "
                               f"CUDA_MPS_PIPE_DIRECTORY={self.env['CUDA_MPS_PIPE_DIRECTORY']} stops it")
        self._remove()
        atexit.unregister(self.stop)

    def _remove(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root, self.env = None, {}


DAEMON = Daemon()
"""The process's one daemon: started with the local Ray (``coordinator.init_ray``), quit with it
(``coordinator.shutdown_ray``)."""
