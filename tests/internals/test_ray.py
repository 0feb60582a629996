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

init_ray(SimpleNamespace(address=None, num_cpus=1, num_gpus=None, log_to_driver=True, mps=False))

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
