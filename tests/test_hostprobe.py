"""benchmarks.hostprobe: the host's CPUs sampled around a command and lined up with a run's steps."""

from __future__ import annotations

import json
import sys
import time

from benchmarks import hostprobe
from benchmarks.hostprobe import Sampler, canary_ratio, gc_seconds, machine_shares, spy_functions, summarize
from xrlhf.engines.host import log_gc

# A child that maps a file of a name nothing else maps (the probe tags it as the sampler tags
# vLLM's process, by its maps), then keeps one CPU busy for ~2.5 s.
BUSY = """
import gc, mmap, os, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
from xrlhf.engines.host import GC_LOG_ENV, log_gc
log_gc(os.environ[GC_LOG_ENV], "busy-0")
t = time.time()
while time.time() - t < 2.5:
    sum(range(1000))
    gc.collect(0)
"""


def test_a_busy_child_is_tagged_and_its_cpu_lines_up_with_a_step(tmp_path, monkeypatch):
    marker = tmp_path / "xrlhf-probe-marker.bin"
    marker.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(hostprobe, "MARKER", marker.name)
    probe = tmp_path / "probe"
    sampler = Sampler(probe, interval=0.1).start()
    t0 = time.time()
    import subprocess

    import os

    from xrlhf.engines.host import GC_LOG_ENV

    subprocess.run([sys.executable, "-c", BUSY, str(marker)], check=True, timeout=120,
                   env={**os.environ, GC_LOG_ENV: str(probe / "gc")})
    t1 = time.time()
    time.sleep(0.3)
    sampler.stop()
    rows = [json.loads(line) for line in (probe / "samples.jsonl").read_text().splitlines()]
    assert len(rows) >= 5
    assert any(p["vllm"] for r in rows for p in r["procs"])  # the child was found by its maps
    # a run whose one generation span covers the child's life, on the epoch clock
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"timeline_origin": t0 - 10.0}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "timeline": [["generator", "b1", 10.0, 10.0 + (t1 - t0)],
                                                                           ["trainer", "train", 0.0, 1.0]]}) + "\n")
    (row,) = summarize(probe, [run])
    assert row["step"] == 1 and row["samples"] >= 3
    # the child kept about one CPU busy (a loaded box gives it less; the sampling edges cost some)
    assert 0.2 < row["vllm_cpus"] <= 1.2
    assert row["vllm_threads"] and row["vllm_threads"][0]["ran_on"] >= 1
    assert 0.0 < row["busy"] <= 1.0 and 0.0 <= row["steal"] < 1.0
    assert row["gc_n"] > 10 and 0.0 < row["gc_s"] < t1 - t0 and row["gc2_s"] == 0.0  # its gen-0 collections
    assert row["canary"] is not None and row["canary"] > 0  # the canary of the child's CPU ran beside it
    assert len(list(probe.glob("canary-*.jsonl"))) == len(os.sched_getaffinity(0))  # one per CPU


def test_log_gc_writes_each_collection(tmp_path):
    import gc

    before = list(gc.callbacks)
    try:
        log_gc(str(tmp_path), "policy-0")
        gc.collect()
        time.sleep(1.1)
        gc.collect(1)  # more than a second after the last write: both are written now
    finally:
        gc.callbacks[:] = before
    (f,) = tmp_path.glob("gc-policy-0-*.jsonl")
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    gens = [r[2] for r in rows]  # (automatic collections may fall between the two asked for)
    assert gens[-1] == 1 and 2 in gens and all(r[0] <= r[1] for r in rows)


def test_gc_seconds_and_canary_by_hand():
    cols = [[0.0, 1.0, 0, 5], [2.0, 2.5, 2, 100], [9.0, 9.1, 1, 0]]
    # [0.5, 2.2]: half of the first, 0.2 s of the gen-2 one; the last is outside
    assert gc_seconds(cols, 0.5, 2.2) == {"gc_s": 0.7, "gc2_s": 0.2, "gc_n": 2}
    canary = [[1.0, 0.002], [2.0, 0.004], [3.0, 0.004], [9.0, 0.002]]
    assert canary_ratio(canary, 1.5, 3.5, 0.002) == 2.0 and canary_ratio(canary, 20, 30, 0.002) is None


def test_machine_shares_by_hand():
    # two samples of the total's jiffies: user, nice, system, idle, iowait, irq, softirq, steal
    ws = [{"cpu": {"cpu": [30, 0, 10, 50, 0, 0, 0, 10]}, "mhz": [2000.0, 3000.0]},
          {"cpu": {"cpu": [50, 0, 0, 40, 10, 0, 0, 0]}, "mhz": [2000.0, 3000.0]}]
    # busy = 1 - (idle 90 + iowait 10 + steal 10) / 200
    assert machine_shares(ws) == {"busy": 0.45, "steal": 0.05, "iowait": 0.05, "mhz": 2500}
    assert machine_shares([]) == {}


def test_spy_functions_takes_the_busiest_thread_and_its_innermost_frames(tmp_path):
    spy = tmp_path / "pyspy"
    spy.mkdir()
    loop = "thread (0x1);run (vllm/loop.py:10);step (vllm/core.py:20)"
    (spy / "100.000.txt").write_text(
        f"{loop};schedule (vllm/sched.py:5) 6\n"
        f"{loop};tolist (numpy/x.py:1) 3\n"
        "thread (0x2);wait (threading.py:300) 1\n")
    (spy / "200.000.txt").write_text(f"{loop};schedule (vllm/sched.py:5) 50\n")  # outside the window
    got = spy_functions(tmp_path, 99.5, 150.0)
    assert got["thread"] == "thread (0x1)" and got["samples"] == 9 and got["thread_share"] == 0.9
    assert got["leaf"] == {"schedule (vllm/sched.py:5)": 0.667, "tolist (numpy/x.py:1)": 0.333}
    assert got["ours"] == {"schedule (vllm/sched.py:5)": 0.667, "step (vllm/core.py:20)": 0.333}
    assert spy_functions(tmp_path / "none", 0, 1) is None
