"""TRL's process beside xrlhf's benchmarks: on its own stack (``--trl-site``) or on xrlhf's."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.common import ROOT, trl_env

PROBE = "import json, sys, trl, xrlhf; print(json.dumps([trl.__file__, xrlhf.__file__, sys.path]))"


def _probe(env: dict[str, str]) -> list:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_site_comes_first_and_replaces_xrlhfs_stack(tmp_path, monkeypatch):
    """TRL imports from its site, the repository stays importable, xrlhf's PYTHONPATH is gone."""
    site, other = tmp_path / "site-trl", tmp_path / "site-xrlhf"
    (site / "trl").mkdir(parents=True)
    (site / "trl" / "__init__.py").write_text("")
    (other / "trl").mkdir(parents=True)
    (other / "trl" / "__init__.py").write_text("raise ImportError('xrlhf stack')")
    monkeypatch.setenv("PYTHONPATH", str(other))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,2")
    env = trl_env(str(site), gpus=2)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert env["PATH"].split(os.pathsep)[0] == str(site / "bin")
    trl_file, xrlhf_file, path = _probe(env)
    assert trl_file == str(site / "trl" / "__init__.py")
    assert xrlhf_file.startswith(str(ROOT))
    assert str(other) not in path


def test_without_a_site_trl_runs_on_the_callers_stack(tmp_path, monkeypatch):
    other = tmp_path / "site-xrlhf"
    (other / "trl").mkdir(parents=True)
    (other / "trl" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(other))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = trl_env(None)
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert _probe(env)[0] == str(other / "trl" / "__init__.py")


def test_a_site_without_trl_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="--trl-site: .* holds no trl package"):
        trl_env(str(tmp_path))


class _Sampler:
    def __init__(self, busy):
        self.busy, self.closed = busy, False

    def utilization(self):
        return self.busy

    def close(self):
        self.closed = True


def test_trls_run_is_sampled_as_xrlhfs_is(tmp_path):
    """The GPU samplers beside xrlhf's runs run beside TRL's too (the same load on each side): read
    and closed when TRL's process ends, even one that failed, their mean busy share recorded."""
    from benchmarks.w_vs_trl import run_trl, samplers_for

    site = tmp_path / "site-trl"  # a stack whose TRL cannot be imported: the process fails at once
    (site / "trl").mkdir(parents=True)
    (site / "trl" / "__init__.py").write_text("raise ImportError('no TRL here')")
    samplers = [_Sampler(40.0), _Sampler(None), _Sampler(60.0)]
    out = run_trl("float32", "no-model", tmp_path, steps=1, timed_from=1, timeout=120, site=str(site),
                  samplers=samplers)
    assert out["trl_rc"] not in (0, "timeout") and out["trl_step_s"] is None
    assert out["trl_gpu_busy"] == 50.0
    assert all(s.closed for s in samplers)
    assert samplers_for([{"index": 0}], period_ms=0) == []  # --sample-ms 0: neither side sampled
