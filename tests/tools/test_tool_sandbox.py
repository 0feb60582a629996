"""A user's own tool, sandboxed by default: its writes outside its work dir and its connections fail,
a call past its timeout kills the sandbox and is an error observation, the next call gets a fresh
worker; with ``sandbox: none`` it runs in the trainer's process and is still bounded by its timeout.

Each hostile tool runs under every sandbox this machine offers (namespaces where they work, and
process isolation, the fallback everywhere else); nothing is left running after a test.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import time

import pytest

from xrlhf.tools import build_tool, call_tool, tool_errors
from xrlhf.tools.python import namespaces_unavailable
from xrlhf.tools.sandbox import SandboxedTool, ToolStartError

psutil = pytest.importorskip("psutil")

NS = pytest.mark.skipif(namespaces_unavailable() is not None, reason=f"no namespace sandbox: {namespaces_unavailable()}")
SANDBOXES = [pytest.param("namespaces", marks=NS), "process"]

TOOLS = '''
import os, socket, time
from pydantic import Field
from xrlhf.tools import Tool, ToolOptions, ToolResult


class Writer(Tool):
    name = "writer"
    description = "writes its argument's path"

    def run(self, arguments):
        path = self.text_argument(arguments)
        with open(path, "w") as f:
            f.write("x")
        return ToolResult(f"wrote {path}; cwd {os.getcwd()}")


class Dialer(Tool):
    name = "dialer"
    description = "connects to host:port"

    def run(self, arguments):
        host, port = self.text_argument(arguments).split(":")
        s = socket.socket()
        s.settimeout(2)
        s.connect((host, int(port)))
        return ToolResult("connected")


class SleepOptions(ToolOptions):
    timeout_s: float = 1.0


class Sleeper(Tool):
    name = "sleeper"
    description = "sleeps N seconds, or answers at once; counts its calls"
    Config = SleepOptions
    calls = 0

    def run(self, arguments):
        type(self).calls += 1
        time.sleep(float(self.text_argument(arguments)))
        return ToolResult(f"pid {os.getpid()} call {type(self).calls}")


class Quitter(Tool):
    name = "quitter"
    description = "ends its process"

    def run(self, arguments):
        os._exit(7)


class Broken(Tool):
    name = "broken"
    description = "cannot be built"

    def __init__(self, config=None):
        raise RuntimeError("no table here")

    def run(self, arguments):
        return ToolResult("")
'''


def stray_workers() -> list:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any("xrlhf-tool-" in part for part in p.info["cmdline"] or []):
            found.append(p.info)
    return found


@pytest.fixture(autouse=True)
def no_stray_workers():
    yield
    deadline = time.monotonic() + 5
    while (left := stray_workers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in left:
        psutil.Process(p["pid"]).kill()
    assert not left, f"tool workers left behind: {left}"


@pytest.fixture
def own_tools(tmp_path, monkeypatch):
    """``own_tools.py`` in a dir of its own on the import path (readable by the namespace
    sandbox's unprivileged user, as a user's package dir is)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir(mode=0o755)
    (pkg / "own_tools.py").write_text(TOOLS)
    os.chmod(pkg, 0o755)
    monkeypatch.syspath_prepend(str(pkg))
    yield "own_tools"
    sys.modules.pop("own_tools", None)


def test_own_tools_are_sandboxed_by_default_builtins_are_not(own_tools):
    tool = build_tool("own_tools:Writer")
    assert isinstance(tool, SandboxedTool) and tool.name == "writer" and tool.config.sandbox == "auto"
    assert "audit hook" in tool.layers
    assert not isinstance(build_tool("calculator"), SandboxedTool)
    assert not isinstance(build_tool("python"), SandboxedTool)
    tool.close()


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_writes_outside_the_work_dir_do_not_land(own_tools, sandbox, tmp_path):
    tool = build_tool("own_tools:Writer", {"sandbox": sandbox})
    inside = call_tool(tool, "notes.txt")
    assert not inside.error and "xrlhf-tool-" in inside.output, inside.output  # its own work dir is writable
    outside = [tmp_path / "escape.txt", f"/tmp/xrlhf-escape-{os.getpid()}.txt"]
    try:
        for path in outside:
            result = call_tool(tool, str(path))
            assert result.error and not os.path.exists(path), result.output
            assert result.output.split(":")[1].strip() in ("PermissionError", "FileNotFoundError", "OSError")
    finally:
        for path in outside:
            if os.path.exists(path):
                os.remove(path)
    tool.close()


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_connections_fail(own_tools, sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    try:
        tool = build_tool("own_tools:Dialer", {"sandbox": sandbox})
        result = call_tool(tool, f"127.0.0.1:{server.getsockname()[1]}")
        assert result.error and "connected" not in result.output
        assert "Network is unreachable" in result.output or "sandbox: socket.connect" in result.output, result.output
        with pytest.raises(BlockingIOError):
            server.accept()
        tool.close()
    finally:
        server.close()


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_stuck_call_kills_its_sandbox_and_the_next_call_gets_a_fresh_one(own_tools, sandbox):
    tool = build_tool("own_tools:Sleeper", {"sandbox": sandbox})
    first = call_tool(tool, "0")
    assert first.output.endswith("call 1")
    start = time.monotonic()
    stuck = call_tool(tool, "600")
    assert stuck.error and stuck.timed_out and stuck.output == "error: timed out after 1 s (its sandbox was killed)"
    assert time.monotonic() - start < 15  # 1 s, and the kill: generous for a loaded machine
    after = call_tool(tool, "0")
    assert not after.error and after.output.endswith("call 1"), after.output  # a new worker, a new tool
    if sandbox == "process":  # (in the namespace sandbox every worker is PID 1)
        assert after.output.split()[1] != first.output.split()[1]
    tool.close()


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_tool_that_ends_its_process_is_an_error_observation(own_tools, sandbox):
    tool = build_tool("own_tools:Quitter", {"sandbox": sandbox})
    result = call_tool(tool, "x")
    assert result.error and not result.timed_out
    assert result.output.startswith("error: the tool's sandbox process ended (exit status 7"), result.output
    tool.close()


def test_a_tool_that_cannot_be_built_says_why_at_start_and_in_each_call(own_tools):
    tool = build_tool("own_tools:Broken")
    with pytest.raises(ToolStartError, match="RuntimeError: no table here"):
        tool.start()
    starts = []
    start_worker = tool.pool._start
    tool.pool._start = lambda: starts.append(1) or start_worker()
    result = call_tool(tool, "x")
    assert result.error and "could not start in its sandbox: RuntimeError: no table here" in result.output
    assert not starts  # known already: no second start
    tool.close()


def test_sandbox_none_runs_in_process_and_is_still_bounded(own_tools, tmp_path):
    writer = build_tool("own_tools:Writer", {"sandbox": "none"})
    assert not isinstance(writer, SandboxedTool)
    path = tmp_path / "in-process.txt"
    assert call_tool(writer, str(path)).output.startswith(f"wrote {path}")  # trusted: nothing stops it
    sleeper = build_tool("own_tools:Sleeper", {"sandbox": "none", "timeout_s": 0.5})
    assert call_tool(sleeper, "0").output == f"pid {os.getpid()} call 1"  # the trainer's own process
    start = time.monotonic()
    stuck = call_tool(sleeper, "30")
    assert stuck.timed_out and stuck.output == "error: timed out after 0.5 s (the call was abandoned)"
    assert time.monotonic() - start < 10  # not the 30 s call: abandoned at 0.5 s


def test_sandbox_none_stops_calling_a_tool_whose_calls_pile_up(own_tools, monkeypatch):
    from xrlhf.tools import base

    monkeypatch.setattr(base, "MAX_ABANDONED", 2)
    sleeper = importlib.import_module(own_tools).Sleeper
    piler = type("Piler", (sleeper,), {"name": "piler"})(sleeper.Config(sandbox="none", timeout_s=0.2))
    assert [call_tool(piler, "30").timed_out for _ in range(2)] == [True, True]
    refused = call_tool(piler, "0")
    assert refused.error and not refused.timed_out and refused.output == (
        "error: not called: 2 earlier calls of tool 'piler' are still running past their timeout")


def test_config_errors_name_the_option(own_tools, monkeypatch):
    from xrlhf.tools import sandbox

    monkeypatch.setattr(sandbox, "namespaces_unavailable", lambda: "needs root (euid 1000)")
    assert tool_errors([{"name": "own_tools:Writer", "options": {"sandbox": "namespaces"}}], "env.options.tools") == [
        "env.options.tools[0].options.sandbox: 'namespaces' does not work here (needs root (euid 1000)); set it to "
        "'auto' or 'process'"]
    assert not build_tool("own_tools:Writer").namespaces  # auto falls back to process isolation
    local = type("Local", (importlib.import_module(own_tools).Writer,), {"name": "local"})
    local.__qualname__ = "make.<locals>.Local"
    errors = sandbox.sandbox_errors(local, local.Config(), "env.options.tools[0].options.sandbox")
    assert errors == ["env.options.tools[0].options.sandbox: tool class make.<locals>.Local is defined in a function, "
                      "which a sandbox worker cannot import; move it into a module, or set sandbox: none (in the "
                      "trainer's process)"]


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_concurrent_calls_use_several_workers(own_tools, sandbox):
    import threading

    tool = build_tool("own_tools:Sleeper", {"sandbox": sandbox, "timeout_s": 30})
    results = [None] * 6

    def work(i):
        results[i] = call_tool(tool, "0.3")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None and not r.error for r in results), results
    assert len(tool.pool._idle) <= 4
    tool.close()



ORPHANING = """
import os, sys, threading, time
sys.path.insert(0, sys.argv[2])
from xrlhf.tools import build_tool, call_tool
tool = build_tool("own_tools:Sleeper", {"sandbox": sys.argv[1], "timeout_s": 600})
tool.start()
threading.Thread(target=call_tool, args=(tool, "600"), daemon=True).start()
time.sleep(1)
print("calling", flush=True)
os._exit(3)  # the trainer dies mid-call, leaving no chance to clean up
"""


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_worker_stuck_in_a_call_ends_with_the_trainer(own_tools, sandbox):
    import subprocess

    pkg = next(p for p in sys.path if p.endswith("pkg"))
    proc = subprocess.run([sys.executable, "-c", ORPHANING, sandbox, pkg], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 3 and proc.stdout == "calling\n", proc.stderr
    # no_stray_workers: the worker (and its sandbox) exited within seconds, though its call sleeps 600 s


def test_a_worker_that_cannot_import_xrlhf_reports_it_in_one_line(tmp_path):
    """The sandbox worker's boot program, given an import path without xrlhf (as for a user who
    cannot read xrlhf's directory), answers its start with one line, not a traceback."""
    import json
    import os
    import subprocess
    import sys

    from xrlhf.tools._tool_worker import BOOT

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        cfg = {"path": [str(tmp_path / "empty"), str(locked)]}
        out = subprocess.run([sys.executable, "-S", "-s", "-B", "-u", "-c", BOOT, json.dumps(cfg)],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env={"PATH": os.environ.get("PATH", "")})
    finally:
        locked.chmod(0o700)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    reply = json.loads(out.stdout)
    assert reply["ready"] is False and reply["error"].startswith("ModuleNotFoundError: No module named 'xrlhf'")
    if os.geteuid() != 0:  # root reads any directory
        assert f"cannot read {locked}" in reply["error"]


def test_a_package_the_sandbox_cannot_read_is_named(tmp_path, monkeypatch):
    """A tool's package of mode 0700 inside a readable directory on the import path: the hint
    names the package's directory, not only the import path's entries. ``os.access`` answers as
    for the namespace sandbox's fresh uid (root, which runs this suite, reads any directory)."""
    import os

    from xrlhf.tools import _tool_worker

    (tmp_path / "mypkg" / "sub").mkdir(parents=True)
    (tmp_path / "mypkg").chmod(0o700)
    locked = str(tmp_path / "mypkg")
    real = os.access
    monkeypatch.setattr(_tool_worker.os, "access", lambda p, mode: real(p, mode) and os.fspath(p) != locked)
    assert _tool_worker.unreadable([str(tmp_path)], "mypkg.sub.tool") == [locked]
    assert _tool_worker.unreadable([str(tmp_path)], "other.tool") == []
    assert _tool_worker.unreadable([locked], "") == [locked]  # an entry of the path itself, as before
