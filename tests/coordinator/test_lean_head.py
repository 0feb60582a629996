"""``coordinator.lean_head``: a local Ray started by ``init_ray`` runs without the dashboard's API
server and the autoscaler's monitor, and still has what a run needs of it (actors; the log
monitor, which brings the workers' prints to the driver's console); ``XRLHF_RAY_FULL_HEAD=1``
brings Ray's whole head back. Each case runs
in a process of its own: pytest's may hold the session's Ray (``ray_session``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two Ray start-ups

SCRIPT = """
import json, os
from types import SimpleNamespace
import psutil, ray
from xrlhf.coordinator.coordinator import init_ray

init_ray(SimpleNamespace(address=None, num_cpus=1, num_gpus=None, log_to_driver=True, mps=False))

@ray.remote
class Echo:
    def pid(self):
        return os.getpid()

pid = ray.get(Echo.remote().pid.remote(), timeout=300)
lines = []
for p in psutil.Process().children(recursive=True):
    try:
        lines.append(" ".join(p.cmdline()))
    except psutil.Error:  # gone meanwhile (a worker Ray prestarted and let go)
        pass
ray.shutdown()
print(json.dumps({"actor": pid, "processes": lines}))
"""


def head(full: bool) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("XRLHF_RAY_FULL_HEAD", None)
    if full:
        env["XRLHF_RAY_FULL_HEAD"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_local_ray_starts_without_the_dashboard_and_the_monitor():
    out = head(full=False)
    assert out["actor"] > 0
    assert [p for p in out["processes"] if "log_monitor.py" in p]  # workers' output reaches the driver
    assert not [p for p in out["processes"] if "dashboard/dashboard.py" in p or "autoscaler/_private/monitor.py" in p]
    assert [p for p in out["processes"] if "raylet" in p]


def test_the_whole_head_on_request():
    out = head(full=True)
    assert [p for p in out["processes"] if "dashboard/dashboard.py" in p]
    assert [p for p in out["processes"] if "autoscaler/_private/monitor.py" in p]
