"""NVIDIA MPS for one GPU shared by a trainer and an awake generator (``ray.mps``).

Why: processes that share a GPU each have a CUDA context of their own, and the GPU runs one
context at a time (time slices), so a one-step-off run on one GPU (vLLM generating batch s+1
while the trainer updates on batch s) overlaps only the host's idle time. Under MPS the
processes' kernels run side by side (the measured gain: docs/async.md, "MPS on one GPU").

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
from collections.abc import Mapping
from pathlib import Path

from loguru import logger

from xrlhf.coordinator.spec import Topology, anchor_of
from xrlhf.internals import HOOKS_OFF
from xrlhf.internals.process import MPS_DAEMON

CONTROL = "nvidia-cuda-mps-control"


SM_LIMIT = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def sm_limit_warning(environ: Mapping[str, str] = os.environ) -> str | None:
    """A warning where the environment limits an MPS client's SMs (every Ray worker inherits it).

    Why: cuBLAS's bf16 GEMMs were measured wrong (finite garbage or NaN, no error) under most SM
    limits, and a model's loss can look right while some shapes are wrong, so nothing at run time
    can vouch for a limit (the limits and shapes: docs/async.md, docs/design/probes.md)."""
    value = environ.get(SM_LIMIT, "").strip()
    if not value:
        return None
    try:
        if float(value) >= 100:
            return None
    except ValueError:
        pass
    return (f"{SM_LIMIT}={value} limits every MPS client's SMs, and cuBLAS GEMMs were measured wrong (NaN or "
            "garbage, no error) under most limits on an H100 (docs/async.md); unset it unless a check like "
            "the SM-limit probe of docs/design/probes.md passes on this GPU")


def mps_option_errors(mps: bool | str, address: str | None) -> list[str]:
    """``ray.mps: true`` on a local Ray (no ``address``) needs NVIDIA's control binary and the
    hook that starts its daemon (``internals.process.MPS_DAEMON``, off with the public-only switch)."""
    if mps is not True or address:
        return []
    if MPS_DAEMON.switched_off():
        return ["ray.mps: true starts an MPS daemon of the run's own, a process trick that the public-only switch "
                f"(or {HOOKS_OFF}) turns off; set ray.mps=auto or false, or leave the hook on"]
    if shutil.which(CONTROL) is None:
        return [f"ray.mps: true needs NVIDIA's {CONTROL} on PATH (the NVIDIA driver's utilities); install it, "
                "or set ray.mps=auto (MPS where it is installed) or false"]
    return []


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
    return overlaps_on_a_gpu(topology) and shutil.which(CONTROL) is not None and MPS_DAEMON.active()


class Daemon:
    """This run's MPS control daemon: ``start`` returns the variables its clients need."""

    def __init__(self):
        self.root: Path | None = None
        self.env: dict[str, str] = {}

    def start(self, required: bool = False) -> dict[str, str]:
        """Start the daemon (a few ms); the clients' environment. A daemon already named by the
        environment is used, not started. Where it does not start, ``required`` (``ray.mps:
        true``) raises; else the run goes on without MPS, with a warning."""
        quit_orphans()
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
        self.root = Path(tempfile.mkdtemp(prefix=PREFIX))
        (self.root / "owner").write_text(str(os.getpid()))
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}
        for d in self.env.values():
            os.makedirs(d)
        try:
            done = subprocess.run([binary, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True,
                                  timeout=30, check=False)
            failure = None if done.returncode == 0 else f"exit {done.returncode}: {(done.stderr or done.stdout).strip()}"
        except (OSError, subprocess.TimeoutExpired) as e:
            failure = str(e)
        if failure is not None:
            self._remove()
            if required:
                raise RuntimeError(f"MPS: {CONTROL} -d failed ({failure}) and ray.mps is true")
            logger.warning(f"MPS: {CONTROL} -d failed ({failure}); running without MPS (ray.mps: auto), so on a "
                           "shared GPU the trainer's and the generator's kernels take turns")
            return {}
        atexit.register(self.stop)
        logger.info(f"MPS: a control daemon of this run's own ({self.env['CUDA_MPS_PIPE_DIRECTORY']}): the "
                    "trainer's and the generator's kernels run side by side on the GPU (ray.mps)")
        return dict(self.env)

    def stop(self) -> None:
        """Quit the daemon (after its clients, Ray's workers, have exited) and remove its directories."""
        if self.root is None:
            return
        _quit(self.root)
        self._remove()
        atexit.unregister(self.stop)

    def _remove(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root, self.env = None, {}


PREFIX = "xrlhf-mps-"


def _quit(root: Path) -> None:
    """Ask the daemon whose directories are under ``root`` to quit (it waits for its clients)."""
    binary = shutil.which(CONTROL)
    if binary is None:
        return
    try:
        subprocess.run([binary], input="quit\n", env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe")},
                       capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning(f"MPS: the daemon of {root} did not quit ({e}); `echo quit | {CONTROL}` with "
                       f"CUDA_MPS_PIPE_DIRECTORY={root / 'pipe'} stops it")


def quit_orphans() -> None:
    """Quit the daemons of earlier runs on this machine whose process is gone (a run killed with
    SIGKILL cannot quit its own), and remove their directories."""
    for root in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            owner = int((root / "owner").read_text())
            os.kill(owner, 0)
            continue  # its run is alive
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue  # not ours to judge (another user's, or being created)
        if (root / "pipe" / "control").exists():
            _quit(root)
        shutil.rmtree(root, ignore_errors=True)
        logger.info(f"MPS: quit the daemon of a run that is gone ({root})")


DAEMON = Daemon()
"""The process's one daemon: started with the local Ray (``coordinator.init_ray``), quit with it
(``coordinator.shutdown_ray``)."""
