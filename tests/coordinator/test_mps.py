"""``ray.mps`` (coordinator/mps.py): when a run wants NVIDIA MPS, and the daemon's life.

No GPU here: NVIDIA's control binary is stood in for by a script on PATH that records how it was
called, so what is checked is what xrlhf asks of it (``-d`` with a pipe and a log directory of the
run's own, ``quit`` at the end, the local Ray's workers seeing the pipe directory). What MPS does
on a GPU is measured by ``benchmarks/gpu.sh hooks_async`` (docs/async.md)."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from xrlhf.config import XConfig
from xrlhf.coordinator import mps
from xrlhf.topology import topology
from xrlhf.utils.errors import UserError
from xrlhf.validation import validate_dict

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """``nvidia-cuda-mps-control`` on PATH: appends each call (arguments, stdin, pipe directory) to
    a JSON-lines file and creates the pipe directory's ``control`` socket stand-in on ``-d``."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    script = bin_dir / mps.CONTROL
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys
        stdin = "" if "-d" in sys.argv else sys.stdin.read()
        pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
        if "-d" in sys.argv:
            open(os.path.join(pipe, "control"), "w").close()
        with open({str(calls)!r}, "a") as f:
            f.write(json.dumps({{"argv": sys.argv[1:], "stdin": stdin, "pipe": pipe,
                                "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY", "")}}) + "\\n")
        """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    (tmp_path / "t").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t"))  # the daemons' directories: not the real /tmp's

    def read() -> list[dict]:
        return [json.loads(x) for x in calls.read_text().splitlines()] if calls.is_file() else []

    return read


def _topology(base_config, **changes):
    data = copy.deepcopy(base_config)
    data["policy"]["resources"] = {"ranks": 1, "gpus_per_rank": 1}
    for key, value in changes.items():
        section, field = key.split("__")
        data.setdefault(section, {})[field] = value
    return topology(XConfig.model_validate(data), "model")


def test_auto_means_one_step_off_on_the_trainers_gpu(base_config, fake_control):
    assert mps.wanted(_topology(base_config, rollout__max_staleness=1))
    assert not mps.wanted(_topology(base_config))  # synchronous: the two take turns anyway
    split = _topology(base_config, rollout__max_staleness=1)
    split.spec("rollout").resources = split.spec("rollout").resources.model_copy(
        update={"colocate_with": None, "gpus_per_rank": 1})
    assert not mps.wanted(split)  # a GPU of its own: nothing to share
    cpu = topology(XConfig.model_validate({**base_config, "rollout": {"max_staleness": 1}}), "model")
    assert not mps.wanted(cpu)  # no GPU
    assert not mps.wanted(_topology(base_config, rollout__max_staleness=1, ray__address="auto"))  # not our nodes
    assert not mps.wanted(_topology(base_config, rollout__max_staleness=1, ray__mps=False))
    assert mps.wanted(_topology(base_config, ray__mps=True))
    asleep = _topology(base_config, rollout__max_staleness=1)
    _, spec = asleep.spec("rollout").engines["generate"]
    spec.options = spec.options.model_copy()
    object.__setattr__(spec.options, "sleep_level", 1)  # vLLM's option (no vLLM here): asleep while training
    assert not mps.wanted(asleep)


def test_auto_without_the_binary_runs_without_mps(base_config, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not mps.wanted(_topology(base_config, rollout__max_staleness=1))


def test_true_without_the_binary_is_one_line_before_anything_starts(base_config, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UserError) as e:
        validate_dict({**base_config, "ray": {"num_cpus": 2, "mps": True}})
    assert e.value.messages == [(f"ray.mps: true needs NVIDIA's {mps.CONTROL} on PATH (the NVIDIA driver's "
                                 "utilities); install it, or set ray.mps=auto (MPS where it is installed) or false")]
    validate_dict({**base_config, "ray": {"num_cpus": 2, "mps": True, "address": "auto"}})  # a cluster's own


def test_the_daemon_is_the_runs_own_and_quits(fake_control):
    daemon = mps.Daemon()
    env = daemon.start()
    pipe, log = Path(env["CUDA_MPS_PIPE_DIRECTORY"]), Path(env["CUDA_MPS_LOG_DIRECTORY"])
    assert (pipe / "control").exists() and log.is_dir() and len(str(pipe / "control")) < 108
    daemon.stop()
    assert [(c["argv"], c["stdin"].strip(), c["pipe"]) for c in fake_control()] == [
        (["-d"], "", str(pipe)), ([], "quit", str(pipe))]
    assert not pipe.exists() and not log.exists()
    daemon.stop()  # twice: nothing more
    assert len(fake_control()) == 2


def test_a_daemon_that_does_not_start_is_a_warning_under_auto(fake_control, tmp_path, monkeypatch):
    failing = tmp_path / "bin" / mps.CONTROL
    failing.write_text("#!/bin/sh\necho 'no GPU here' >&2\nexit 3\n")
    daemon = mps.Daemon()
    assert daemon.start() == {} and daemon.root is None
    assert not list((tmp_path / "t").iterdir())  # its directories removed
    with pytest.raises(RuntimeError, match="no GPU here"):
        daemon.start(required=True)


def test_the_daemon_of_a_killed_run_is_quit_by_the_next(fake_control, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    orphan = tmp_path / "t" / (mps.PREFIX + "orphan")
    (orphan / "pipe").mkdir(parents=True)
    (orphan / "pipe" / "control").touch()
    (orphan / "owner").write_text(dead.stdout.strip())
    alive = tmp_path / "t" / (mps.PREFIX + "alive")
    (alive / "pipe").mkdir(parents=True)
    (alive / "owner").write_text(str(os.getpid()))  # a run still going: left alone
    mps.quit_orphans()
    assert [(c["argv"], c["stdin"].strip(), c["pipe"]) for c in fake_control()] == [
        ([], "quit", str(orphan / "pipe"))]
    assert not orphan.exists() and alive.exists()


def test_a_daemon_the_environment_names_is_used_not_started(fake_control, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    daemon = mps.Daemon()
    assert daemon.start() == {}
    daemon.stop()
    assert fake_control() == []


@pytest.mark.slow
def test_a_local_rays_workers_are_its_clients(fake_control, tmp_path):
    """``init_ray(mps=True)`` in a fresh process: a Ray actor sees the pipe directory, and
    ``shutdown_ray`` quits the daemon after Ray."""
    program = textwrap.dedent("""\
        import json, os, ray, tempfile
        from xrlhf.config.schema import RayConfig

        tempfile.tempdir = os.environ["MPS_TEST_TMP"]  # the daemon's directories (Ray's stay in /tmp: short paths)
        from xrlhf.coordinator.coordinator import init_ray, shutdown_ray

        assert init_ray(RayConfig(num_cpus=1), mps=True)

        @ray.remote(num_cpus=0)
        def pipe():
            return os.environ.get("CUDA_MPS_PIPE_DIRECTORY")

        seen = ray.get(pipe.remote(), timeout=120)
        driver = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
        shutdown_ray()
        print(json.dumps({"worker": seen, "driver_after_init": driver}))
        """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled", "MPS_TEST_TMP": str(tmp_path / "t")})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    calls = fake_control()
    assert [c["argv"] for c in calls] == [["-d"], []] and calls[1]["stdin"].strip() == "quit"
    assert out["worker"] == calls[0]["pipe"]  # the worker is a client of the run's daemon
    assert out["driver_after_init"] is None  # the driver's environment is given back
    assert not Path(calls[0]["pipe"]).exists()


def test_an_sm_limit_in_the_environment_is_warned_about():
    """cuBLAS GEMMs were measured wrong under most MPS SM limits (docs/async.md): a limit below 100%
    in the environment, which every Ray worker inherits, is named with the fix; none, 100%, nothing."""
    assert mps.sm_limit_warning({}) is None
    assert mps.sm_limit_warning({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}) is None
    warning = mps.sm_limit_warning({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"})
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75" in warning and "unset it" in warning
