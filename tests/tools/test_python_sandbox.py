"""The python tool's sandbox: each limit is contained, reported as an error result, and the caller
goes on; nothing is left behind (processes, files, the work dir).

Every hostile program runs under each isolation this machine offers: the namespace sandbox with
the audit hook, the namespace sandbox alone (the kernel layers must hold by themselves), and
process isolation with the audit hook (the fallback where namespaces do not work).
"""

import os
import socket
import threading
import time

import pytest

from xrlhf.tools import build_tool, call_tool
from xrlhf.tools import python as python_tool
from xrlhf.tools.python import SANDBOX_UIDS, namespaces_unavailable

psutil = pytest.importorskip("psutil")

NS = pytest.mark.skipif(namespaces_unavailable() is not None,
                        reason=f"no namespace sandbox: {namespaces_unavailable()}")
MODES = {
    "namespaces+hook": pytest.param({"isolation": "namespaces"}, marks=NS, id="namespaces+hook"),
    "namespaces": pytest.param({"isolation": "namespaces", "audit_hook": False}, marks=NS, id="namespaces"),
    "process+hook": pytest.param({"isolation": "process"}, id="process+hook"),
}
ALL_MODES = list(MODES.values())


def sandbox_processes() -> list:
    """Processes of a sandbox still alive: its temp dir in their command line, or a sandbox uid."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        cmdline, uids = p.info["cmdline"] or [], p.info["uids"]
        sandbox_uid = uids is not None and SANDBOX_UIDS[0] <= uids.real < SANDBOX_UIDS[1]
        if sandbox_uid or any("xrlhf-python-" in part for part in cmdline):
            found.append(p.info)
    return found


@pytest.fixture(autouse=True)
def no_stray_processes():
    yield
    deadline = time.monotonic() + 3
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in left:  # clean up before failing, so one failure does not spill into other tests
        psutil.Process(p["pid"]).kill()
    assert not left, f"sandbox processes left behind: {left}"


def run(options: dict, code: str, **extra):
    return call_tool(build_tool("python", {**options, **extra}), code)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize("options", ALL_MODES)
def test_output_and_the_work_dir(options):
    code = ("import os\nopen('notes.txt', 'w').write('hello')\n"
            "print(open('notes.txt').read(), sorted(os.listdir('.')))\nprint(os.getcwd())")
    result = run(options, code)
    assert not result.error, result.output
    first, cwd = result.output.splitlines()
    assert first == "hello ['notes.txt']"
    assert "xrlhf-python-" in cwd and not os.path.exists(cwd) and not os.path.exists(os.path.dirname(cwd))


@pytest.mark.parametrize("options", ALL_MODES)
def test_exceptions_and_exit_status(options):
    result = run(options, "def f(x):\n    return 1 / x\nprint('before')\nf(0)")
    assert result.error and result.output.startswith("before\nTraceback")
    assert last_line(result.output) == "ZeroDivisionError: division by zero"
    assert 'File "<program>", line 2, in f' in result.output and "hook" not in result.output
    assert run(options, "import sys; sys.exit(3)").output == "error: exit status 3"


@pytest.mark.parametrize("options", ALL_MODES)
def test_infinite_loop_times_out(options):
    start = time.monotonic()
    result = run(options, "print('started')\nwhile True:\n    pass", timeout_s=1)
    assert result.error and result.timed_out and result.output == "started\nerror: timed out after 1 s"
    assert time.monotonic() - start < 15  # 1 s and the kill, on a loaded machine
    assert run(options, "print('next')").output == "next"  # the caller goes on


@pytest.mark.parametrize("options", ALL_MODES)
def test_two_gigabytes_is_a_memory_error(options):
    result = run(options, "x = bytearray(2 * 1024**3)\nprint(len(x))")
    assert result.error and last_line(result.output) == "MemoryError"


FORK_BOMB = """
import os, time
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
"""


@pytest.mark.parametrize("options", ALL_MODES)
def test_fork_bomb_is_contained(options):
    start = time.monotonic()
    result = run(options, FORK_BOMB, timeout_s=1)
    assert result.error and "timed out after 1 s" in result.output
    assert time.monotonic() - start < 20  # 1 s and the kill, on a loaded machine
    # no_stray_processes checks that every process it started is gone


@pytest.mark.parametrize("options", [MODES["namespaces"]])
def test_process_limit_holds_without_the_audit_hook(options):
    code = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError as e:\n"
            "        print(n, e.errno)\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
            "    n += 1")
    result = run(options, code, max_processes=8)
    assert not result.error, result.output
    forks, errno = map(int, result.output.split())
    assert forks <= 7 and errno == 11  # EAGAIN: the fresh uid's RLIMIT_NPROC, counting the program itself
    # the sleeping children die with the namespace's PID 1 (checked by no_stray_processes)


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


@pytest.mark.parametrize("options", ALL_MODES)
def test_network_is_unreachable(options, listener):
    port = listener.getsockname()[1]
    for host, p in (("1.1.1.1", 53), ("127.0.0.1", port)):
        code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(({host!r}, {p}))\n"
                f"print('connected')")
        result = run(options, code)
        assert result.error and "connected" not in result.output, result.output
        assert any(e in last_line(result.output) for e in ("Network is unreachable", "sandbox: socket.connect"))
    with pytest.raises(BlockingIOError):
        listener.accept()


@pytest.mark.parametrize("options", ALL_MODES)
def test_writes_outside_the_work_dir_do_not_land(options, tmp_path):
    outside = [tmp_path / "escape.txt", f"/tmp/xrlhf-escape-{os.getpid()}.txt"]
    try:
        for path in outside:
            result = run(options, f"open({str(path)!r}, 'w').write('x')\nprint('written')")
            assert result.error and "written" not in result.output
            assert last_line(result.output).split(":")[0] in ("PermissionError", "FileNotFoundError", "OSError")
            assert not os.path.exists(path)
    finally:
        for path in outside:
            if os.path.exists(path):
                os.remove(path)


@pytest.mark.parametrize("options", [MODES["namespaces"]])
def test_namespace_sandbox_sees_only_the_interpreter_and_runs_unprivileged(options):
    result = run(options, "import os\nprint(os.getuid(), os.path.exists('/etc/hostname'), os.path.exists('/work'))")
    uid, etc, work = result.output.split()
    assert SANDBOX_UIDS[0] <= int(uid) < SANDBOX_UIDS[1] and etc == work == "False"


def test_output_is_capped():
    result = run({}, "print('x' * 100_000)\nprint('the end')", max_output_chars=300)
    assert not result.error and len(result.output) <= 300
    assert result.output.endswith("the end") and "cut" in result.output


def test_concurrent_calls_from_threads():
    tool = build_tool("python")
    results = [None] * 4

    def work(i):
        results[i] = call_tool(tool, f"print({i} * 10)")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.output for r in results] == ["0", "10", "20", "30"]


def test_isolation_choice(monkeypatch):
    monkeypatch.setattr(python_tool, "namespaces_unavailable", lambda: "needs root (euid 1000)")
    with pytest.raises(ValueError, match=r"isolation 'namespaces' does not work here \(needs root"):
        build_tool("python", {"isolation": "namespaces"})
    auto = build_tool("python")
    assert not auto.uses_namespaces and "audit hook" in auto.layers and "chroot" not in auto.layers
    assert call_tool(auto, "print(2 + 2)").output == "4"
