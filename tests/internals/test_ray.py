"""``internals.ray.lean_head``: a local Ray started by ``init_ray`` runs without the dashboard's API
server and the autoscaler's monitor, and still has what a run needs of it (actors; the log
monitor, which brings the workers' prints to the driver's console); the hook switched off
(``XRLHF_HOOKS_OFF=ray.lean_head``) brings Ray's whole head back. Its workers run at the driver's
priority (``ray.worker_niceness``), or at Ray's nice 15 with that hook off. Each case runs in a
process of its own: pytest's may hold the session's Ray (``ray_session``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # three Ray start-ups

SCRIPT = """
import json, os
from types import SimpleNamespace
import psutil, ray
from xrlhf.coordinator.coordinator import init_ray, shutdown_ray

init_ray(SimpleNamespace(address=None, num_cpus=1, num_gpus=None, log_to_driver=True))

@ray.remote
class Echo:
    def pid(self):
        return os.getpid()

    def nice(self):
        return os.nice(0)

echo = Echo.remote()
pid = ray.get(echo.pid.remote(), timeout=300)
niceness = ray.get(echo.nice.remote(), timeout=300)
lines = []
for p in psutil.Process().children(recursive=True):
    try:
        lines.append(" ".join(p.cmdline()))
    except psutil.Error:  # gone meanwhile (a worker Ray prestarted and let go)
        pass
shutdown_ray()
print(json.dumps({"actor": pid, "processes": lines, "nice": [os.nice(0), niceness]}))
"""


def head(off: str | None = None) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("XRLHF_HOOKS_OFF", None)
    env.pop("XRLHF_PUBLIC_ONLY", None)
    if off:
        env["XRLHF_HOOKS_OFF"] = off
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_local_ray_starts_without_the_dashboard_and_the_monitor():
    out = head()
    assert out["actor"] > 0
    assert [p for p in out["processes"] if "log_monitor.py" in p]  # workers' output reaches the driver
    assert not [p for p in out["processes"] if "dashboard/dashboard.py" in p or "autoscaler/_private/monitor.py" in p]
    assert [p for p in out["processes"] if "raylet" in p]
    driver, worker = out["nice"]
    assert worker == driver  # the workers at the driver's priority (ray.worker_niceness)


def test_the_whole_head_on_request():
    out = head("ray.lean_head")
    assert [p for p in out["processes"] if "dashboard/dashboard.py" in p]
    assert [p for p in out["processes"] if "autoscaler/_private/monitor.py" in p]


def test_without_the_niceness_hook_the_workers_run_lower():
    out = head("ray.worker_niceness")
    driver, worker = out["nice"]
    assert worker > driver  # Ray's own nice 15


RETRY_SCRIPT = """
import json, os
from types import SimpleNamespace
import psutil, ray
from xrlhf.coordinator import coordinator
from xrlhf.coordinator.coordinator import init_ray, shutdown_ray

real_init, calls, gcs = ray.init, [], []
WAIT = os.environ.get("RAY_gcs_server_port_wait_time_s", "180")


def gcs_servers():
    return {p.pid for p in psutil.Process().children(recursive=True) if "gcs_server" in " ".join(p.cmdline())}


def first_start_fails(*args, **kwargs):
    # the first head's GCS gets no time to publish its port: a real failed start, its GCS left running
    calls.append(len(calls))
    os.environ["RAY_gcs_server_port_wait_time_s"] = "0" if len(calls) == 1 else WAIT
    try:
        return real_init(*args, **kwargs)
    finally:
        gcs.append(sorted(gcs_servers()))


coordinator.ray.init = first_start_fails
init_ray(SimpleNamespace(address=None, num_cpus=1, num_gpus=None, log_to_driver=False))


@ray.remote
def one():
    return 1


answer = ray.get(one.remote(), timeout=300)
after = sorted(gcs_servers())
shutdown_ray()
print(json.dumps({"calls": len(calls), "answer": answer, "gcs": gcs, "after": after}))
"""


def test_a_head_that_fails_to_start_is_stopped_and_started_again():
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    proc = subprocess.run([sys.executable, "-c", RETRY_SCRIPT], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["calls"] == 2 and out["answer"] == 1
    failed = set(out["gcs"][0])  # the first head's GCS, alive when its start timed out
    assert failed and not failed & set(out["after"])  # killed before the second start
    assert len(out["after"]) == 1
    assert "Ray's local head did not start" in proc.stderr and "starting it once more" in proc.stderr
