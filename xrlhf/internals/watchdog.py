"""The run's watchdog: when the driver dies, however it dies, the processes it started die too.

Why: a local Ray shares fate with its driver only in part. Its GCS and raylet get SIGKILL when
the driver dies (Ray sets their parent-death signal), but the raylet's own children, the
DashboardAgent and the RuntimeEnvAgent, then report the raylet's death to the GCS, which is gone:
a call that waits 60 s and keeps their event loop from handling SIGTERM (Ray 2.60; measured 62 s
after a SIGKILLed driver). Ray has no public option to start a local node without them.

Run as ``python -I -S watchdog.py <driver pid> [<pid>:<start> ...]`` (the standard library only:
it starts in a few milliseconds) by ``internals.process.Watchdog``, in a session of its own, so
that a Ctrl-C in the terminal or a kill of the driver's process group does not reach it; the
``<pid>:<start>`` pairs are the driver's descendants before it, which are not the run's. While the
driver lives, it notes the driver's other descendants (pid and start time, so that a pid used
again later is never taken for one of them) every :data:`SCAN_S`. Once the driver is
gone (the watchdog's parent changed) it sends SIGTERM to each noted process still alive and to
their descendants, SIGKILL after :data:`GRACE_S` to those left, and exits: everything is gone
within about ``POLL_S + GRACE_S`` of the driver's death. SIGTERM to the watchdog (the driver's
orderly stop, at Ray's shutdown) ends it without killing anything.
"""

import os
import signal
import sys
import time

POLL_S = 0.2
"""How often the watchdog checks that the driver lives."""
SCAN_S = 1.0
"""How often it notes the driver's descendants."""
GRACE_S = 1.0
"""Between SIGTERM and SIGKILL."""


def read_table() -> dict[int, tuple[int, int]]:
    """Every process of the machine: pid -> (parent pid, start time in clock ticks since boot)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended meanwhile
        if len(fields) > 19 and fields[0] != b"Z":  # fields[0] is the state (field 3): a zombie is dead
            table[int(name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(table: dict[int, tuple[int, int]], roots: set[int]) -> set[int]:
    """The pids of ``table`` below any of ``roots`` (the roots not included)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def noted(table: dict[int, tuple[int, int]], driver: int, older: dict[int, int], me: int) -> dict[int, int]:
    """The driver's descendants but the watchdog and those ``older`` than it: pid -> start time."""
    return {pid: table[pid][1] for pid in descendants(table, {driver})
            if pid != me and older.get(pid) != table[pid][1]}


def left_of(known: dict[int, int], me: int) -> dict[int, int]:
    """Of the processes ``known`` (pid -> start time), those still alive, with every process
    below them: pid -> start time."""
    table = read_table()
    alive = {pid for pid, start in known.items() if table.get(pid, (0, -1))[1] == start}
    return {pid: table[pid][1] for pid in alive | descendants(table, alive) if pid != me}


def kill_all(known: dict[int, int], me: int) -> None:
    """SIGTERM to what is left of ``known``, SIGKILL to what still is (or started below it)
    :data:`GRACE_S` later."""
    targets = left_of(known, me)
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while targets and time.monotonic() < deadline:
        time.sleep(0.05)
        targets = left_of(targets, me)
    for pid in targets:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def watch(driver: int, older: dict[int, int]) -> None:
    """Note ``driver``'s descendants (but ``older``) until it dies, then kill what is left of them."""
    me = os.getpid()
    known: dict[int, int] = {}
    last_scan = 0.0
    while os.getppid() == driver:
        if time.monotonic() - last_scan >= SCAN_S:
            known.update(noted(read_table(), driver, older, me))
            last_scan = time.monotonic()
        time.sleep(POLL_S)
    kill_all(known, me)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the driver's orderly stop
    older = dict(tuple(map(int, pair.split(":"))) for pair in argv[2:])
    watch(int(argv[1]), older)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
