"""The GPU sampler of the benchmarks against a stand-in ``nvidia-smi`` on PATH: memory, busy share,
and the clock fields where the driver knows them (a driver that refuses them leaves memory and busy)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from benchmarks.common import DeviceMemorySampler

LINES = ["1024, 50, 1980, 400.5, 40, 0x0000000000000000",
         "2048, 100, 1500, 699.0, 60, 0x0000000000000004",  # held down by the power cap
         "1536, 90, 1700, 650.0, 55, 0x0000000000000001"]  # idle is no slowdown


def _fake_smi(tmp_path, monkeypatch, knows_clocks: bool):
    script = tmp_path / "nvidia-smi"
    probe = "exit 0" if knows_clocks else 'echo "Field is not a valid field to query." >&2; exit 2'
    rows = LINES if knows_clocks else [",".join(line.split(",")[:2]) for line in LINES]
    body = "\n".join(f'echo "{r}"' for r in rows)
    script.write_text(f"""#!/bin/sh
case "$*" in
  *-lms=*) {body}
           exec sleep 30 ;;
  *) {probe} ;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def _wait_for(sampler: DeviceMemorySampler, n: int) -> None:
    deadline = time.monotonic() + 60  # a loaded box starts the stand-in slowly
    while len(sampler._util) < n:
        if time.monotonic() > deadline:
            pytest.fail(f"the sampler read {len(sampler._util)} of {n} lines")
        time.sleep(0.05)


@pytest.mark.parametrize("knows_clocks", [True, False])
def test_memory_busy_and_where_known_the_clocks(tmp_path, monkeypatch, knows_clocks):
    _fake_smi(tmp_path, monkeypatch, knows_clocks)
    s = DeviceMemorySampler(gpu=0, period_ms=50)
    try:
        _wait_for(s, 3)
        assert s.peak() == 2.0 and s.utilization() == 80.0
        w = s.window(0.0, time.time() + 1)
        if not knows_clocks:  # a driver without the clock names: memory and busy alone
            assert w == {}
            return
        assert w == {"sm_mhz": round((1980 + 1500 + 1700) / 3, 1), "power_w": round((400.5 + 699 + 650) / 3, 1),
                     "temp_c": 51.7, "slowed": 0.333}
        assert s.window(0.0, 1.0) == {}  # no sample in that span
        s.reset()
        assert s.utilization() is None and s.window(0.0, time.time() + 1) == {}
    finally:
        s.close()
