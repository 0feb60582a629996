"""Process tricks: the fork server's primitives (imports held back, exit handlers run by hand, a
child that dies with its parent, modules imported again) and the run's own MPS daemon.

The fork server (``coordinator/forkserver.py``) and the MPS daemon (``coordinator/mps.py``) are
built from public calls apart from what is here; each is one hook, off with the public-only switch.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import importlib
import os
import signal
import sys

from xrlhf.internals import Hook

def _exit_handlers() -> str | None:
    return None if callable(getattr(atexit, "_run_exitfuncs", None)) else "atexit has no _run_exitfuncs"


FORK_SERVER = Hook(
    "process.fork_server", "python", ("3.11", "3.12"),
    buys="Ray's workers are forked with torch, transformers and vLLM imported, while Ray starts "
         "(ray.fork_server)",
    without="every worker imports its engines after Ray started it",
    probe=lambda: _exit_handlers() or (None if sys.platform.startswith("linux") else "the fork server runs on Linux only"))

MPS_DAEMON = Hook(
    "process.mps_daemon", "python", ("3.11", "3.12"),
    buys="a run starts its own CUDA MPS control daemon, so that the trainer's and vLLM's kernels "
         "overlap on one GPU one step off (ray.mps)",
    without="no MPS daemon: processes on one GPU take turns (ray.mps: true is refused)",
    probe=lambda: None if sys.platform.startswith("linux") else "NVIDIA's MPS runs on Linux only")


class NoImport:
    """Within the block, ``import <name>`` (and its submodules) fails as if the package were absent,
    for ``importlib.import_module`` and ``find_spec`` too; records the modules that tried (to
    import them again where the package is back: ``reimport``)."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why
        self.tried: list[str] = []
        self._import = builtins.__import__

    def __call__(self, name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (name == self.name or name.startswith(self.name + ".")):
            importer = (globals or {}).get("__name__")
            if importer and importer not in self.tried:
                self.tried.append(importer)
            raise ModuleNotFoundError(f"No module named {name!r} ({self.why})", name=name)
        return self._import(name, globals, locals, fromlist, level)

    def __enter__(self) -> "NoImport":
        sys.modules[self.name] = None
        builtins.__import__ = self
        return self

    def __exit__(self, *exc) -> None:
        builtins.__import__ = self._import
        if sys.modules.get(self.name, 0) is None:
            del sys.modules[self.name]


def reimport(modules: list[str]) -> None:
    """Import ``modules`` again (those that found a package absent under ``NoImport``)."""
    for name in modules:
        if sys.modules.get(name) is not None:
            importlib.reload(sys.modules[name])


def run_exit_handlers() -> None:
    """Run this process's ``atexit`` handlers now: a forked child leaves by ``os._exit``, which
    skips them, and its Ray worker's handlers flush what it logged."""
    atexit._run_exitfuncs()


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """This process gets ``sig`` when its parent ends, however it ends (Linux's parent-death
    signal); elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def cuda_touched() -> str | None:
    """Why a child forked from this process could not use CUDA (``None``: it can): CUDA
    initialised here, or, by a test fork, torch's own flag in the child."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return "CUDA was initialised while importing"
    from xrlhf.internals.torch import BAD_FORK, in_bad_fork

    if not BAD_FORK.active():
        return None
    pid = os.fork()
    if pid == 0:
        os._exit(3 if in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else "CUDA was touched while importing"
