"""The ``python`` tool: runs a model's program in a sandboxed subprocess.

A model that writes code writes infinite loops, 2 GB allocations, fork bombs and the odd network
call; none of them may stall or damage the run. Each call gets a fresh, throw-away work dir and a
new process (never the trainer's interpreter), with layers that each hold on their own:

* **always** (``isolation: process``): a scrubbed environment, ``python -S -s`` (no site-packages,
  hash seed 0), resource limits set by the runner itself (``RLIMIT_AS``, ``RLIMIT_CPU``,
  ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core files), a wall-clock timeout that kills the whole
  process group (``start_new_session``), output capped, the work dir removed;
* **namespaces** (root on Linux, ``_sandbox_ns.py``): new mount, network, PID, IPC and UTS
  namespaces; a chroot holding only read-only system dirs, the interpreter and a size-limited
  tmpfs work dir; a fresh unprivileged uid, so ``RLIMIT_NPROC`` bounds the processes (root
  ignores it); the kernel kills every process of the sandbox with its PID 1;
* **audit hook** (``audit_hook: true``, ``_sandbox_run.py``): refuses process creation, sockets,
  writes outside the work dir and ctypes in the program's interpreter. A tripwire, not a boundary.

``isolation: auto`` uses namespaces where a probe run shows they work and process isolation
otherwise (with a warning). docs/tools.md lists what each layer stops, as measured.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from loguru import logger
from pydantic import Field

from xrlhf.tools.base import Tool, ToolOptions, ToolResult, one_line, register_tool

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "_sandbox_run.py"
LAUNCHER = HERE / "_sandbox_ns.py"
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
"""Host dirs visible (read-only) inside the namespace sandbox, besides the interpreter's prefix."""
SANDBOX_UIDS = (1_000_000, 2_000_000)
"""Range of the fresh uid each namespace sandbox runs as (none of them is a user of the host)."""
SETUP_FAILED = 125
RUNNER_SOURCE = RUNNER.read_text(encoding="utf-8")


class PythonOptions(ToolOptions):
    """Options of the ``python`` tool."""

    memory_mb: int = Field(256, ge=64, description="address-space limit of the program (RLIMIT_AS), MiB")
    disk_mb: int = Field(16, ge=1, description="work-dir size (namespaces: a tmpfs of this size) and the "
                         "largest file the program may write (RLIMIT_FSIZE), MiB")
    max_processes: int = Field(16, ge=1, description="RLIMIT_NPROC: processes and threads of the namespace "
                               "sandbox's fresh uid (not set under process isolation)")
    max_open_files: int = Field(64, ge=16, description="RLIMIT_NOFILE")
    isolation: Literal["auto", "namespaces", "process"] = Field(
        "auto", description="namespaces: chroot + mount/net/pid namespaces + a fresh uid (needs root); "
        "process: rlimits and the audit hook only; auto: namespaces where they work")
    audit_hook: bool = Field(True, description="refuse fork/exec, sockets, writes outside the work dir and "
                             "ctypes inside the program's interpreter (a second layer)")
    sandbox: Literal["none"] = Field("none", description="the tool itself runs in the trainer's process; each "
                                     "program runs in a sandbox of its own (isolation)")


@register_tool("python")
class PythonTool(Tool):
    """Runs a Python program (standard library only) in a sandbox; the output is what it prints.

    A non-zero exit, an exception, a timeout or a limit gives ``error=True``; the output is then
    the program's stdout followed by its stderr, whose last line says what went wrong.

    Raises (construction):
        ValueError: ``isolation: namespaces`` on a machine where namespaces do not work.
    """

    description = "runs a Python program (standard library only) and returns what it prints"
    argument = "code"
    Config = PythonOptions
    enforces_timeout = True  # the program's process group is killed at timeout_s

    def __init__(self, config: PythonOptions | None = None):
        super().__init__(config)
        if self.config.isolation == "namespaces" and (reason := namespaces_unavailable()):
            raise ValueError(f"python tool: isolation 'namespaces' does not work here ({reason}); "
                             f"set the tool's option isolation to 'auto' or 'process'")

    @property
    def uses_namespaces(self) -> bool:
        """Whether calls run in the namespace sandbox (else process isolation only)."""
        if self.config.isolation == "auto":
            return namespaces_unavailable() is None
        return self.config.isolation == "namespaces"

    @property
    def layers(self) -> list[str]:
        """The sandbox layers calls run under, for logs and docs."""
        layers = ["process group + timeout", "rlimits", "scrubbed env", "fresh work dir"]
        if self.uses_namespaces:
            layers += ["mount/net/pid/ipc/uts namespaces", "chroot", "fresh uid", "no_new_privs"]
        return layers + (["audit hook"] if self.config.audit_hook else [])

    def run(self, arguments: str | dict[str, Any]) -> ToolResult:
        """Run the program; see the class docstring for the result."""
        return self.run_code(self.text_argument(arguments), self.uses_namespaces)

    def run_code(self, code: str, namespaces: bool) -> ToolResult:
        """Run ``code`` in a fresh work dir, in the namespace sandbox or with process isolation."""
        base = Path(tempfile.mkdtemp(prefix="xrlhf-python-"))
        try:
            return self._run_in(base, code, namespaces)
        finally:
            remove_tree(base)

    def _run_in(self, base: Path, code: str, namespaces: bool) -> ToolResult:
        work, out, err, program = base / "work", base / "stdout", base / "stderr", base / "program.py"
        work.mkdir(mode=0o700)
        program.write_text(code, encoding="utf-8")
        argv, env = self._command(base, work, namespaces)
        with open(program, "rb") as stdin, open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=work, env=env,
                                    start_new_session=True, close_fds=True)
        finished = wait_for_exit(proc.pid, self.config.timeout_s)
        stop(proc.pid, finished, namespaces)
        rc = proc.wait()
        limit = self.config.max_output_chars * 4 + 1024
        return self._result(rc, not finished, read_capped(out, limit), read_capped(err, limit))

    def _command(self, base: Path, work: Path, namespaces: bool) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that start the runner, directly or through the launcher."""
        c = self.config
        exe = os.path.realpath(sys.executable)
        runner_cfg = {"work": str(work), "memory_mb": c.memory_mb, "cpu_s": math.ceil(c.timeout_s) + 1,
                      "file_mb": c.disk_mb, "max_files": c.max_open_files, "audit_hook": c.audit_hook,
                      # counted per uid: meaningful only for the namespace sandbox's fresh uid (a
                      # non-root user's limit would count the trainer's own threads too)
                      "max_processes": c.max_processes if namespaces else None}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONUTF8": "1"}
        argv = [exe, "-S", "-s", "-B", "-u", "-c", RUNNER_SOURCE, json.dumps(runner_cfg)]
        if not namespaces:
            return argv, env
        (base / "root").mkdir()
        launcher_cfg = {"root": str(base / "root"), "work": str(work), "binds": visible_dirs(exe),
                        "uid": secrets.choice(range(*SANDBOX_UIDS)), "disk_mb": c.disk_mb, "argv": argv, "env": env}
        return [exe, "-I", "-S", str(LAUNCHER), json.dumps(launcher_cfg)], env

    def _result(self, rc: int, timed_out: bool, stdout: str, stderr: str) -> ToolResult:
        if timed_out:
            return ToolResult(join(stdout, f"error: timed out after {self.config.timeout_s:g} s"), error=True,
                              timed_out=True)
        if rc == 0:
            return ToolResult(stdout.rstrip("\n"))
        if rc == SETUP_FAILED and stderr.startswith("sandbox setup failed"):
            return ToolResult(f"error: {one_line(stderr)}", error=True)
        if rc < 0:
            stderr = join(stderr, f"error: killed by {signal.Signals(-rc).name}{limit_hint(-rc)}")
        elif not stderr.strip():
            stderr = f"error: exit status {rc}"
        return ToolResult(join(stdout, stderr), error=True)


def limit_hint(signum: int) -> str:
    """Which limit a killing signal usually means."""
    return {signal.SIGXCPU: " (cpu time limit)", signal.SIGXFSZ: " (file size limit)"}.get(signum, "")


def join(*parts: str) -> str:
    """Non-empty ``parts`` on separate lines."""
    return "\n".join(p.rstrip("\n") for p in parts if p.strip())


def visible_dirs(exe: str) -> list[str]:
    """Host dirs bound read-only into the namespace sandbox: the system dirs and the interpreter's
    prefix (and the executable's dir), unless a system dir covers them."""
    dirs = [d for d in SYSTEM_DIRS if os.path.lexists(d)]
    for extra in (os.path.realpath(sys.base_prefix), os.path.dirname(exe)):
        if not any(extra == d or extra.startswith(d + "/") for d in dirs):
            dirs.append(extra)
    return dirs


def wait_for_exit(pid: int, timeout: float) -> bool:
    """Wait until child ``pid`` exits or ``timeout`` seconds pass, without reaping it (so its
    process group cannot be reused before :func:`stop`). Returns whether it exited."""
    if not hasattr(os, "pidfd_open"):  # not Linux: poll
        deadline = time.monotonic() + timeout
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True
    fd = os.pidfd_open(pid)
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def stop(pid: int, finished: bool, namespaces: bool) -> None:
    """Leave nothing of the sandbox whose first process is child ``pid`` (not yet reaped).

    After a timeout in the namespace sandbox, PID 1 of the namespace is killed first and the
    launcher given up to 5 s to reap it: PID 1 exits only once the kernel has killed every other
    process of its namespace. Then the whole process group is killed (``start_new_session``
    made ``pid`` its leader; an unreaped leader keeps the group id from being reused).
    """
    if not finished and namespaces:
        for child in children(pid):
            try:
                fd = os.pidfd_open(child)
            except OSError:  # gone already
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            finally:
                os.close(fd)
        wait_for_exit(pid, 5.0)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``; empty where unreadable)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def read_capped(path: Path, limit: int) -> str:
    """The text of ``path``; of a file over ``limit`` bytes, its first and last ``limit // 2``."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= limit:
            data = f.read()
        else:
            head = f.read(limit // 2)
            f.seek(size - limit // 2)
            data = head + f"\n...[output cut: {size} bytes in all]...\n".encode() + f.read()
    return data.decode("utf-8", errors="replace")


def remove_tree(path: Path) -> None:
    """Remove ``path`` even where the program took away its own permissions."""
    def retry(func, p, _exc):
        os.chmod(os.path.dirname(p), stat.S_IRWXU)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, stat.S_IRWXU)
        func(p)

    shutil.rmtree(path, onerror=retry)


@functools.lru_cache(maxsize=1)
def namespaces_unavailable() -> str | None:
    """Why the namespace sandbox cannot run here (``None`` when it can): it needs Linux and root,
    and a probe program must print through it. Computed once per process."""
    if not sys.platform.startswith("linux"):
        reason = f"not Linux ({sys.platform})"
    elif os.geteuid() != 0:
        reason = f"needs root (euid {os.geteuid()})"
    else:
        probe = PythonTool(PythonOptions(isolation="process", timeout_s=20)).run_code("print('ok')", namespaces=True)
        reason = None if probe.output.strip() == "ok" else one_line(probe.output)
    if reason:
        logger.warning(f"namespace sandbox unavailable ({reason}): the python tool's isolation 'auto' and a tool's "
                       f"sandbox 'auto' fall back to process isolation (rlimits, process group, audit hook)")
    return reason
