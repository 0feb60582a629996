"""A user's own tool in a sandbox: built and called in worker processes, killed at its timeout.

A tool is code the user wrote, called with arguments the model wrote, thousands of times a run.
In the trainer's process a tool that never returns stalls the rollout and one that writes files
or opens sockets does so as the trainer (issue 26). So unless its ``sandbox`` option is ``none``,
:func:`xrlhf.tools.build_tool` gives a :class:`SandboxedTool`: the class is imported here only to
read its name, description and options; it is *built* and *called* in a worker process
(``_tool_worker.py``) that runs under the same layers as the ``python`` tool's programs
(``python.py``: the launcher ``_sandbox_ns.py``, the limits and the audit hook of
``_sandbox_run.py``, the same capability probe):

* ``process``: a scrubbed environment, its own process group, resource limits, a fresh work dir
  (cwd, ``HOME``, ``TMPDIR``), the audit hook (no writes outside the work dir, no sockets, no new
  processes, no ctypes);
* ``namespaces`` (root on Linux): also new mount, network, PID, IPC and UTS namespaces, a chroot
  that shows the system dirs, the interpreter and the import path read-only, a tmpfs work dir,
  a fresh unprivileged uid;
* ``auto``: namespaces where they work, else process.

Unlike a ``python`` program, a worker lives on: it builds the tool once and serves call after
call (a call costs a pipe round trip, not an interpreter start). A call past ``timeout_s`` kills
its worker (the whole sandbox) and is an error observation; the next call starts a fresh worker,
so a tool's state does not outlive a timeout. Up to :data:`MAX_WORKERS` workers serve the calls
of one tool at once (episodes step in parallel); more calls wait for a free one.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from loguru import logger

from xrlhf.tools._tool_worker import BOOT
from xrlhf.tools.base import Tool, ToolOptions, ToolResult, one_line
from xrlhf.tools.python import (LAUNCHER, SANDBOX_UIDS, limit_hint, namespaces_unavailable, read_capped, remove_tree,
                                stop, visible_dirs, wait_for_exit)

START_TIMEOUT_S = 60.0
"""How long a worker may take to start (an interpreter, pydantic, the tool's module, its
constructor) on a loaded machine; not counted in a call's ``timeout_s``."""
MAX_WORKERS = 4
"""Workers serving one tool's calls at once."""
LIMITS = {"memory_mb": 4096, "cpu_s": None, "file_mb": 64, "max_files": 256}
"""A worker's resource limits (``_sandbox_run.set_limits``): address space and largest file in
MiB, open files. No CPU-time limit: a worker serves many calls; each is bounded by its timeout."""
MAX_PROCESSES = 64
"""``RLIMIT_NPROC`` of the namespace sandbox's fresh uid (processes and threads)."""
DISK_MB = 64
"""The work dir's size in the namespace sandbox (a tmpfs)."""


class ToolStartError(RuntimeError):
    """A sandboxed tool's worker did not start: its import, its options or its constructor
    failed in the sandbox, or it gave no sign of life within :data:`START_TIMEOUT_S`."""


def sandbox_errors(cls: type[Tool], config: ToolOptions, where: str) -> list[str]:
    """Why ``cls`` with ``config`` cannot run in its sandbox, one line each prefixed with
    ``where`` (the YAML path of the option); empty when it can."""
    errors = []
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        place = "__main__" if cls.__module__ == "__main__" else "a function"
        errors.append(f"{where}: tool class {cls.__qualname__} is defined in {place}, which a sandbox worker cannot "
                      f"import; move it into a module, or set sandbox: none (in the trainer's process)")
    if config.sandbox == "namespaces" and (reason := namespaces_unavailable()):
        errors.append(f"{where}: 'namespaces' does not work here ({reason}); set it to 'auto' or 'process'")
    return errors


def uses_namespaces(sandbox: str) -> bool:
    """Whether ``sandbox`` (``auto``, ``namespaces``, ``process``) means the namespace sandbox here."""
    return sandbox == "namespaces" or (sandbox == "auto" and namespaces_unavailable() is None)


def import_dirs(cls: type) -> list[str]:
    """Where a worker imports from: the roots of the tool's module and of xrlhf (an editable
    install need not be on ``sys.path``), then every dir of ``sys.path``; real paths, once each."""
    roots = []
    for name in (cls.__module__, "xrlhf"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            depth = name.count(".") + (1 if Path(file).name == "__init__.py" else 0)
            roots.append(str(Path(file).resolve().parents[depth]))
    path = [os.path.realpath(p or ".") for p in sys.path if os.path.isdir(p or ".")]
    return list(dict.fromkeys(roots + path))


def namespace_binds(exe: str, dirs: list[str]) -> list[str]:
    """Host dirs bound read-only into the namespace sandbox: the system dirs and the interpreter
    (``python.visible_dirs``), then ``dirs`` not below one of them (a parent before its children)."""
    binds = visible_dirs(exe)
    for d in sorted(dirs, key=len):
        if not any(d == b or d.startswith(b.rstrip("/") + "/") for b in binds):
            binds.append(d)
    return binds


class _Exited(Exception):
    pass


class Worker:
    """One sandboxed process that built the tool and serves its calls, one at a time.

    Args:
        spec: ``{"tool": "pkg.mod:Class", "options": {...}, "path": [dirs]}``.
        namespaces: run it in the namespace sandbox (else process isolation).

    Raises:
        ToolStartError: it did not start (the message says why, in one line).
    """

    def __init__(self, spec: dict[str, Any], namespaces: bool):
        self.namespaces, self.alive = namespaces, True
        self.base = Path(tempfile.mkdtemp(prefix="xrlhf-tool-"))
        work = self.base / "work"
        work.mkdir(mode=0o700)
        argv, env = self._command(spec, work)
        with open(self.base / "log", "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=work,
                                         env=env, start_new_session=True, close_fds=True)
        self._buffer = b""
        try:
            ready = self._read(START_TIMEOUT_S)
        except TimeoutError:
            self.close(orderly=False)
            raise ToolStartError(f"no sign of life after {START_TIMEOUT_S:g} s") from None
        except _Exited:
            raise ToolStartError(self._death()) from None
        if not ready.get("ready"):
            self.close()
            raise ToolStartError(ready.get("error") or "it failed to start")

    def _command(self, spec: dict[str, Any], work: Path) -> tuple[list[str], dict[str, str]]:
        exe = os.path.realpath(sys.executable)
        cfg = {**spec, "work": str(work), "audit_hook": True,
               "limits": {**LIMITS, "max_processes": MAX_PROCESSES if self.namespaces else None}}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONUTF8": "1"}
        argv = [exe, "-S", "-s", "-B", "-u", "-c", BOOT, json.dumps(cfg)]
        if not self.namespaces:
            return argv, env
        (self.base / "root").mkdir()
        launcher = {"root": str(self.base / "root"), "work": str(work), "binds": namespace_binds(exe, spec["path"]),
                    "uid": secrets.choice(range(*SANDBOX_UIDS)), "disk_mb": DISK_MB, "argv": argv, "env": env}
        return [exe, "-I", "-S", str(LAUNCHER), json.dumps(launcher)], env

    def _read(self, timeout: float) -> dict[str, Any]:
        """The next reply line. Raises ``TimeoutError`` after ``timeout`` s, ``_Exited`` at EOF."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise _Exited
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def call(self, arguments: str | dict[str, Any], timeout_s: float) -> ToolResult:
        """One call; a timeout or a crash kills the worker (``alive`` becomes false)."""
        try:
            self.proc.stdin.write((json.dumps({"arguments": arguments}, default=str) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read(timeout_s)
        except TimeoutError:
            self.close(orderly=False)
            return ToolResult(f"error: timed out after {timeout_s:g} s (its sandbox was killed)", error=True,
                              timed_out=True)
        except (_Exited, BrokenPipeError):
            return ToolResult(f"error: the tool's sandbox process ended ({self._death()})", error=True)
        return ToolResult(str(reply["output"]), error=bool(reply["error"]))

    def _death(self) -> str:
        """Why the worker ended (its status, the last line it wrote to stderr); closes it."""
        wait_for_exit(self.proc.pid, 5.0)
        lines = read_capped(self.base / "log", 4096).strip().splitlines()
        self.close(orderly=False)
        rc = self.proc.returncode
        status = f"killed by {signal.Signals(-rc).name}{limit_hint(-rc)}" if rc < 0 else f"exit status {rc}"
        return status + (f": {one_line(lines[-1])}" if lines else "")

    def close(self, orderly: bool = True) -> None:
        """Stop the worker (``orderly``: end its input and give it 2 s first) and remove its dir."""
        if not self.alive:
            return
        self.alive = False
        pid = self.proc.pid
        if orderly:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            wait_for_exit(pid, 2.0)
        # not reaped yet (stop() kills by process group): has it exited?
        finished = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        stop(pid, finished, self.namespaces)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        remove_tree(self.base)


class WorkerPool:
    """Up to ``size`` workers; a call takes an idle one or starts one, else waits for one.

    A worker that failed to build the tool (an import or constructor error: the same at every
    start) makes every later call fail at once with the same error, without another start.
    """

    def __init__(self, start, size: int):
        self._start, self.size = start, size
        self._idle: list[Worker] = []
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False
        self.failed: str | None = None

    def take(self) -> Worker:
        """An idle or new worker, marked busy. Raises ``ToolStartError``."""
        with self._cond:
            while not self._idle and self._busy >= self.size:
                self._cond.wait()
            self._busy += 1
            if self._idle:
                return self._idle.pop()
        try:
            if self.failed:
                raise ToolStartError(self.failed)
            return self._start()
        except BaseException as e:
            if isinstance(e, ToolStartError) and not str(e).startswith("no sign of life"):
                self.failed = str(e)
            self.give(None)
            raise

    def give(self, worker: Worker | None) -> None:
        """Hand back a worker taken with :meth:`take` (a dead one is dropped)."""
        with self._cond:
            self._busy -= 1
            keep = worker is not None and worker.alive and not self._closed
            if keep:
                self._idle.append(worker)
            self._cond.notify()
        if worker is not None and not keep:
            worker.close()

    def close(self) -> None:
        """Stop every idle worker; busy ones are stopped when handed back."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


class SandboxedTool(Tool):
    """Stands for a tool whose calls run in sandboxed workers (module docstring): it has the
    tool's ``name``, ``description``, ``argument`` and validated ``config``; ``run`` never raises
    and never waits past ``timeout_s`` once a worker has the call.

    Args:
        cls: the tool's class (importable by ``module:qualname`` in a worker).
        config: its validated options, ``sandbox`` not ``none``.

    Raises:
        ValueError: the class or the sandbox cannot work (:func:`sandbox_errors`).
    """

    enforces_timeout = True

    def __init__(self, cls: type[Tool], config: ToolOptions):
        errors = sandbox_errors(cls, config, f"tool {cls.name!r}: sandbox")
        if errors:
            raise ValueError(errors[0])
        self.cls, self.config = cls, config
        self.name, self.description, self.argument = cls.name, cls.description, cls.argument  # type: ignore[misc]
        self.namespaces = uses_namespaces(config.sandbox)
        spec = {"tool": f"{cls.__module__}:{cls.__qualname__}", "options": config.model_dump(mode="json"),
                "path": import_dirs(cls)}
        self.pool = WorkerPool(functools.partial(Worker, spec, self.namespaces), MAX_WORKERS)
        self._reported = False
        self._finalizer = weakref.finalize(self, self.pool.close)

    @property
    def layers(self) -> list[str]:
        """The sandbox layers calls run under, for logs and docs."""
        layers = ["worker process + timeout", "rlimits", "scrubbed env", "fresh work dir"]
        if self.namespaces:
            layers += ["mount/net/pid/ipc/uts namespaces", "chroot", "fresh uid", "no_new_privs"]
        return layers + ["audit hook"]

    def start(self) -> None:
        """Start a worker now (else the first call does), so that an import or constructor error
        shows before a run. Raises ``ToolStartError`` with the reason."""
        self.pool.give(self.pool.take())

    def run(self, arguments: str | dict[str, Any]) -> ToolResult:
        try:
            worker = self.pool.take()
        except ToolStartError as e:
            message = f"tool {self.name!r} could not start in its sandbox: {e}"
            if not self._reported:  # once: every later call fails the same way
                self._reported = True
                logger.error(f"{message}; each call of it is an error observation")
            return ToolResult(f"error: {message}", error=True)
        try:
            return worker.call(arguments, self.config.timeout_s)
        finally:
            self.pool.give(worker)

    def close(self) -> None:
        """Stop the workers (also done when the tool is collected and at exit)."""
        self._finalizer()

