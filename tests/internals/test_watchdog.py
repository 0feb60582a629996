"""The run's watchdog (``internals/watchdog.py``): a driver killed with SIGKILL leaves no process it
started, a SIGTERM-deaf one in a session of its own included (what Ray's DashboardAgent is for 60 s
after its driver's death); a process started before the watchdog, and everything after an
orderly stop, are left alone. A whole run killed so: tests/e2e/test_stop.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from xrlhf.internals.process import WATCHDOG
from xrlhf.internals.watchdog import GRACE_S, POLL_S, SCAN_S, descendants

DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from xrlhf.internals.process import Watchdog
    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"]
    older = subprocess.Popen(deaf, start_new_session=True)
    dog = Watchdog()
    dog.start()
    child = subprocess.Popen(deaf, start_new_session=True)  # its own session: a kill of the group misses it
    time.sleep(2.5)  # the watchdog notes it (every SCAN_S)
    if sys.argv[1] == "stop":
        dog.stop()
    print(older.pid, child.pid, flush=True)
    time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _driver(how: str) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, how], stdout=subprocess.PIPE, text=True)
    older, child = map(int, proc.stdout.readline().split())
    return proc, older, child


def _wait_gone(pid: int, timeout: float) -> float:
    t0 = time.monotonic()
    while _alive(pid) and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(autouse=True)
def hook_on():
    if not WATCHDOG.active():
        pytest.skip("the watchdog hook is off here")


def test_a_killed_driver_leaves_no_process_it_started():
    proc, older, child = _driver("run")
    try:
        assert _alive(child) and _alive(older)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone_after = _wait_gone(child, 30)
        # the code's bound: the driver's death seen within POLL_S, SIGKILL GRACE_S after SIGTERM; slack
        # for a loaded 2-core box
        assert not _alive(child), "the SIGTERM-deaf child outlived its killed driver"
        assert gone_after < POLL_S + GRACE_S + 3, gone_after
        assert _alive(older)  # started before the watchdog: not the run's
    finally:
        for pid in (older, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_orderly_stop_kills_nothing():
    proc, older, child = _driver("stop")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(POLL_S + GRACE_S + SCAN_S)
        assert _alive(child) and _alive(older)
    finally:
        for pid in (older, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_descendants_follow_the_parent_links():
    table = {2: (1, 0), 3: (2, 0), 4: (3, 0), 5: (1, 0), 6: (9, 0)}
    assert descendants(table, {2}) == {3, 4}
    assert descendants(table, {1}) == {2, 3, 4, 5}
    assert descendants(table, {7}) == set()
