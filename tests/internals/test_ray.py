"""``internals.ray.lean_head``: a local Ray started by ``init_ray`` runs without the dashboard's API
server and the autoscaler's monitor, and still has what a run needs of it (actors; the log
monitor, which brings the workers' prints to the driver's console); the hook switched off
(``XRLHF_HOOKS_OFF=ray.lean_head``) brings Ray's whole head back. Its workers read the driver's
``packages_distributions`` (``internals.imports``). Each case runs
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
from xrlhf.coordinator import coordinator
from xrlhf.coordinator.coordinator import init_ray, shutdown_ray

init_ray(SimpleNamespace(address=None, num_cpus=1, num_gpus=None, log_to_driver=True, mps=False))

@ray.remote
class Echo:
    def pid(self):
        return os.getpid()

    def package_map(self):
        import importlib.metadata
        import xrlhf.coordinator.worker  # noqa: F401 - what a worker's process imports first
        from xrlhf.internals import imports as package_map
        f = importlib.metadata.packages_distributions
        # as sets: a worker's path lists some directories twice, and its own answer names their
        # distributions twice
        same = {k: set(v) for k, v in f().items()} == {k: set(v) for k, v in package_map.ORIGINAL().items()}
        return f is not package_map.ORIGINAL and same

echo = Echo.remote()
pid = ray.get(echo.pid.remote(), timeout=300)
shared = ray.get(echo.package_map.remote(), timeout=300)
map_file = coordinator._PACKAGE_MAP
lines = []
for p in psutil.Process().children(recursive=True):
    try:
        lines.append(" ".join(p.cmdline()))
    except psutil.Error:  # gone meanwhile (a worker Ray prestarted and let go)
        pass
existed = os.path.exists(map_file)
shutdown_ray()
print(json.dumps({"actor": pid, "processes": lines, "shared_map": shared,
                  "map_file": [existed, os.path.exists(map_file)]}))
"""


def head(full: bool) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("XRLHF_HOOKS_OFF", None)
    env.pop("XRLHF_PUBLIC_ONLY", None)
    if full:
        env["XRLHF_HOOKS_OFF"] = "ray.lean_head"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_local_ray_starts_without_the_dashboard_and_the_monitor():
    out = head(full=False)
    assert out["actor"] > 0
    assert [p for p in out["processes"] if "log_monitor.py" in p]  # workers' output reaches the driver
    assert not [p for p in out["processes"] if "dashboard/dashboard.py" in p or "autoscaler/_private/monitor.py" in p]
    assert [p for p in out["processes"] if "raylet" in p]
    # the workers answer packages_distributions from the driver's file, the same answer (internals.imports);
    # shutdown_ray removes the file
    assert out["shared_map"] is True
    assert out["map_file"] == [True, False]


def test_the_whole_head_on_request():
    out = head(full=True)
    assert [p for p in out["processes"] if "dashboard/dashboard.py" in p]
    assert [p for p in out["processes"] if "autoscaler/_private/monitor.py" in p]
