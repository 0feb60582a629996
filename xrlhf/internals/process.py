"""Process tricks: the fork server's primitives (imports held back, exit handlers run by hand, a
child that dies with its parent, modules imported again) and the watchdog that kills what a killed
driver left (``internals/watchdog.py``).

The fork server (``coordinator/forkserver.py``) is built from public calls apart from what is here;
it is one hook, off with the public-only switch.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from xrlhf.internals import Hook

def _exit_handlers() -> str | None:
    return None if callable(getattr(atexit, "_run_exitfuncs", None)) else "atexit has no _run_exitfuncs"


FORK_SERVER = Hook(
    "process.fork_server", "python", ("3.11", "3.12"),
    buys="Ray's workers are forked with torch, transformers and vLLM imported, while Ray starts "
         "(ray.fork_server)",
    without="every worker imports its engines after Ray started it",
    probe=lambda: _exit_handlers() or (None if sys.platform.startswith("linux") else "the fork server runs on Linux only"))

QUICK_EXIT = Hook(
    "process.quick_exit", "python", ("3.11", "3.12"),
    buys="a run aborted by a second Ctrl-C ends without the interpreter's teardown of every module "
         "(1.2 s of its 2 s on the 2-core box)",
    without="the interpreter's own exit: about a second more",
    probe=_exit_handlers)


def quick_exit(code: int) -> None:
    """End this process now with status ``code``: its exit handlers run, the interpreter's
    teardown (threads joined, every module's objects freed) is skipped. Returns where the hook is
    off (the caller then exits as usual)."""
    if not QUICK_EXIT.active():
        return
    run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


WATCHDOG = Hook(
    "process.watchdog", "python", ("3.11", "3.12"),
    buys="a driver killed with SIGKILL leaves no process: a watchdog kills what it started within ~1.2 s "
         "(Ray's DashboardAgent and RuntimeEnvAgent outlived it by 62 s)",
    without="Ray's own fate-sharing: its agents end about 62 s after a killed driver",
    probe=lambda: None if os.path.isdir("/proc/self") else "the watchdog reads /proc (Linux)")

WATCHDOG_SCRIPT = Path(__file__).with_name("watchdog.py")


class Watchdog:
    """The driver's side of ``internals/watchdog.py``: :meth:`start` before a local Ray starts
    (the watchdog notes the processes started after it), :meth:`stop` once Ray is down."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the watchdog of this process (nothing where the hook is off, or it runs)."""
        if self.running or not WATCHDOG.active():
            return
        from xrlhf.internals.watchdog import descendants, read_table

        table = read_table()
        older = [f"{pid}:{table[pid][1]}" for pid in descendants(table, {os.getpid()})]  # not the run's
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(WATCHDOG_SCRIPT), str(os.getpid()), *older],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        """End the watchdog without it killing anything (SIGTERM)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def descendants_now() -> dict[int, int]:
    """This process's descendants: pid -> start time (``{}`` where there is no /proc to read)."""
    if not os.path.isdir("/proc/self"):
        return {}
    from xrlhf.internals.watchdog import descendants, read_table

    table = read_table()
    return {pid: table[pid][1] for pid in descendants(table, {os.getpid()})}


def kill_started_since(before: dict[int, int]) -> int:
    """Kill (SIGTERM, SIGKILL a second later) this process's descendants that are not in
    ``before`` (``descendants_now``'s), with their own; what a failed start left. Returns how many."""
    from xrlhf.internals.watchdog import kill_all

    new = {pid: start for pid, start in descendants_now().items() if before.get(pid) != start}
    kill_all(new, os.getpid())
    return len(new)


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
