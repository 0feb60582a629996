"""The process Ray starts for a worker where a fork server runs (``forkserver``): it asks the run's
fork server (or its plain copy: the socket it is given) for a child that runs Ray's worker entry
point with everything already imported, then stands in for that child until it ends. Standard
library only, run as ``python -I -S`` (started in ~20 ms): Ray starts it through the actor's
``runtime_env`` ``py_executable``, as

    <python> -I -S fork_client.py <socket> <Ray's worker command: default_worker.py --args ...>

Where no server answers (none runs, it failed to import, it refuses), the client becomes the
usual worker instead (``exec`` of the same Python with Ray's command), so the fork server can
only make a start faster, never break it.

Protocol (one connection per worker): the client sends a 4-byte big-endian length and a JSON
object ``{"argv", "env", "cwd"}``, its standard streams attached (``SCM_RIGHTS``); the server
answers JSON lines: ``{"pid": N}`` (the child), later ``{"exit": code}`` (negative: killed by that
signal), or ``{"exec": why}`` at once (start the usual way). Signals the client gets (SIGTERM,
SIGINT, SIGHUP) go on to the child; if the client is killed outright, its connection closes and
the server kills the child.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time


def _lines(sock: socket.socket):
    """The server's JSON lines, until the connection closes."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)


def _become_usual_worker(command: list[str]) -> None:
    """Ray's worker the usual way: this Python, run again without ``-I -S``, with Ray's command."""
    os.execv(sys.executable, [sys.executable, *command])


def _wait_gone(pid: int) -> None:
    """Until process ``pid`` is gone (the server died before it could say how the child ended)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    path, command = argv[1], argv[2:]
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        body = json.dumps({"argv": command, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(sock, [struct.pack("!I", len(body)) + body], [0, 1, 2])
        replies = _lines(sock)
        first = next(replies, {"exec": "the fork server closed the connection"})
    except OSError as e:
        first = {"exec": f"no fork server at {path} ({e})"}
    if "pid" not in first:
        _become_usual_worker(command)
    pid = first["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    for reply in replies:
        if "exit" in reply:
            code = reply["exit"]
            if code < 0:  # killed by a signal: end the same way, as Ray would have seen the worker end
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code
    _wait_gone(pid)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
