"""What the host's CPUs do while a command runs: why does vLLM's host-bound generate vary?

W's generation phase takes 2.2 s in one step and 4.0 s in the next, for the same build, on one
machine (docs/async.md); vLLM alone varies as much between rounds of one engine. Generation is
bound by one host thread (vLLM's scheduler and output loop), so this samples the host around a
command and lines the samples up with each step's timeline:

* every ``--interval`` s: each CPU's jiffies from ``/proc/stat`` (user, system, idle, iowait,
  irq, softirq, steal: ``steal`` is time the hypervisor gave the vCPU to someone else), each CPU's
  MHz, and for every process that used CPU since the last sample its threads (CPU seconds, the
  CPU each last ran on);
* the process that maps vLLM's ``_C`` library is tagged ``vllm``;
* ``--pyspy S``: ``py-spy record`` of that process in chunks of ``S`` s (raw stacks, non-blocking,
  one file per chunk named by its start time), where ``py-spy`` is on ``PATH`` and may attach;
* every worker's garbage collections (``engines.host.GC_LOG_ENV``, set for the command: ``gc/``);
* canaries: one process pinned to each CPU times a fixed piece of Python (a dict, a sort; ~1 ms)
  every 50 ms (``canary-<cpu>.jsonl``). Where the canary on the CPU of vLLM's loop thread slows
  down with it, that CPU itself ran slower (a neighbour of the virtual machine on the same
  physical core, its clock), not vLLM's own work: the VM's own counters cannot see that.

Run (on the GPU machine)::

    python -m benchmarks.hostprobe --out $OUT/probe [--pyspy 2] -- python -m benchmarks.w_vs_trl ...
    python -m benchmarks.hostprobe --summarize $OUT/probe RUN_DIR [RUN_DIR ...]

``--summarize`` reads ``samples.jsonl`` and each run directory's ``metrics.jsonl`` and
``summary.json`` (``timeline_origin``, the epoch time its timeline counts from), and prints and
writes (``summary.json`` in the probe's folder) per step: the generation span, the machine's
busy and steal shares then, the vLLM process's CPU and its busiest threads (their share of one
CPU and how many CPUs they ran on), the other busiest processes, the seconds the vLLM process
spent collecting garbage, the canary of the loop thread's CPU and the other CPUs' canaries
against their medians over the whole probe and, where
py-spy ran, the functions that held vLLM's loop thread's stacks most.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
MARKER = "vllm/_C"
"""What the generator's process maps (vLLM's compiled library): how the sampler tells it apart."""


def cpu_jiffies() -> dict[str, list[int]]:
    """``/proc/stat``'s per-CPU counters (``cpu`` is the total), in ``STAT_FIELDS`` order."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu"):
            name, *vals = line.split()
            out[name] = [int(v) for v in vals[:len(STAT_FIELDS)]]
    return out


CGROUP_CPU = ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat")  # v2, v1
CGROUP_QUOTA = ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us")


def cgroup_throttling() -> dict[str, int]:
    """The container's CPU throttling counters (``nr_throttled``, ``throttled_usec`` or v1's
    ``throttled_time`` in ns): a CPU quota stops every thread of the container once spent."""
    for path in CGROUP_CPU:
        try:
            pairs = [line.split() for line in Path(path).read_text().splitlines()]
        except OSError:
            continue
        return {k: int(v) for k, v in pairs if k.startswith(("nr_throttled", "throttled", "nr_periods"))}
    return {}


def cpu_mhz() -> list[float]:
    return [float(ln.split(":")[1]) for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("cpu MHz")]


def task_stat(path: Path) -> tuple[str, float, int] | None:
    """(comm, CPU seconds, the CPU it last ran on) of one ``/proc/<pid>[/task/<tid>]/stat``."""
    try:
        text = path.read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    return comm, (int(rest[11]) + int(rest[12])) / HZ, int(rest[36])  # utime, stime (fields 14, 15), processor (39)


CANARY = """
import json, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[2])})
out = open(sys.argv[1], "a")
batch, last = [], time.time()
while True:
    t = time.perf_counter()
    d = {i: str(i) for i in range(1500)}
    sorted((v, k) for k, v in d.items())
    batch.append([round(time.time(), 3), round(time.perf_counter() - t, 6)])
    if time.time() - last > 1.0:
        out.write("".join(json.dumps(b) + "\\n" for b in batch)); out.flush()
        batch, last = [], time.time()
    time.sleep(0.05)
"""
"""A canary: ``python -c CANARY FILE CPU``; ``[epoch, seconds]`` per unit (~1 ms on a 2 GHz core)."""


class Sampler:
    """Samples the host every ``interval`` s into ``out/samples.jsonl`` until ``stop()``."""

    def __init__(self, out: Path, interval: float = 0.25, pyspy: float = 0.0):
        self.out, self.interval, self.pyspy = out, interval, pyspy
        self.out.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._cpu: dict[int, float] = {}  # pid -> CPU seconds at the last sample
        self._threads: dict[tuple[int, int], float] = {}
        self._names: dict[int, str] = {}
        self._vllm: int | None = None
        self._checked: dict[int, float] = {}  # pid -> when its maps were last read
        self._threads_run = [threading.Thread(target=self._loop, daemon=True)]
        self._canaries = [subprocess.Popen([sys.executable, "-c", CANARY, str(out / f"canary-{cpu}.jsonl"), str(cpu)])
                          for cpu in sorted(os.sched_getaffinity(0))]
        if pyspy > 0 and shutil.which("py-spy"):
            self._threads_run.append(threading.Thread(target=self._spy, daemon=True))
        elif pyspy > 0:
            (self.out / "pyspy_error.txt").write_text("py-spy is not on PATH\n")

    def start(self) -> "Sampler":
        for t in self._threads_run:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for c in self._canaries:
            c.kill()
            c.wait()
        for t in self._threads_run:
            t.join(30)

    def _name(self, pid: int) -> str:
        if pid not in self._names:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = ""
            self._names[pid] = cmd[:120]
        return self._names[pid]

    def _is_vllm(self, pid: int, now: float) -> bool:
        if now - self._checked.get(pid, 0.0) < 1.0:
            return False
        self._checked[pid] = now
        try:
            with open(f"/proc/{pid}/maps") as f:
                return any(MARKER in line for line in f)
        except OSError:
            return False

    def _sample(self, prev_cpu: dict[str, list[int]], dt: float) -> tuple[dict[str, Any], dict[str, list[int]]]:
        """One sample's row, and the CPU counters it was taken against."""
        now, cpu = time.time(), cpu_jiffies()
        if self._vllm is not None and not os.path.exists(f"/proc/{self._vllm}"):
            self._vllm = None  # TRL's vLLM ends before xrlhf's starts: find the next one
        delta = {k: [a - b for a, b in zip(v, prev_cpu.get(k, v))] for k, v in cpu.items()}
        procs = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            st = task_stat(Path(entry.path) / "stat")
            if st is None:
                continue
            used = st[1] - self._cpu.get(pid, st[1])
            self._cpu[pid] = st[1]
            if used < 0.02 * dt:
                continue
            if self._vllm is None and used > 0.2 * dt and self._is_vllm(pid, now):
                self._vllm = pid
            threads = []
            try:
                tasks = list(os.scandir(f"/proc/{pid}/task"))
            except OSError:  # the process ended meanwhile
                tasks = []
            for task in tasks:
                ts = task_stat(Path(task.path) / "stat")
                if ts is None:
                    continue
                key = (pid, int(task.name))
                t_used = ts[1] - self._threads.get(key, ts[1])
                self._threads[key] = ts[1]
                if t_used >= 0.02 * dt:
                    threads.append([int(task.name), ts[0], round(t_used, 3), ts[2]])
            procs.append({"pid": pid, "comm": st[0], "cmd": self._name(pid), "cpu_s": round(used, 3),
                          "vllm": pid == self._vllm, "threads": sorted(threads, key=lambda t: -t[2])[:8]})
        return {"t": round(now, 3), "dt": round(dt, 3), "cpu": delta, "mhz": cpu_mhz(), "cgroup": cgroup_throttling(),
                "procs": procs}, cpu

    def _loop(self) -> None:
        prev, last = cpu_jiffies(), time.time()
        quota = []
        for path in CGROUP_QUOTA:
            try:
                quota.append(f"{path}: {Path(path).read_text().strip()}")
            except OSError:
                pass
        (self.out / "host.json").write_text(json.dumps({"cpus": os.cpu_count(), "cgroup_quota": quota,
                                                        "affinity": sorted(os.sched_getaffinity(0))}) + "\n")
        with open(self.out / "samples.jsonl", "a") as f:
            while not self._stop.wait(self.interval):
                now = time.time()
                try:
                    row, prev = self._sample(prev, now - last)
                except Exception as e:  # noqa: BLE001 - a probe keeps sampling; the error is kept
                    with open(self.out / "errors.txt", "a") as err:
                        err.write(f"{now:.3f} {type(e).__name__}: {e}\n")
                    continue
                last = now
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
                f.flush()

    def _spy(self) -> None:
        spy = self.out / "pyspy"
        spy.mkdir(exist_ok=True)
        failures = 0
        while not self._stop.is_set() and failures < 3:
            if self._vllm is None:
                self._stop.wait(0.5)
                continue
            t0 = time.time()
            res = subprocess.run(["py-spy", "record", "--pid", str(self._vllm), "--rate", "100", "--duration",
                                  str(max(1, int(self.pyspy))), "--format", "raw", "--nonblocking", "--threads",
                                  "--output", str(spy / f"{t0:.3f}.txt")], capture_output=True, text=True)
            if res.returncode != 0 and not (spy / f"{t0:.3f}.txt").is_file():
                (self.out / "pyspy_error.txt").write_text(res.stdout[-2000:] + res.stderr[-2000:])
                failures += 1  # three in a row: py-spy cannot attach here; stop trying
                self._stop.wait(1.0)
            else:
                failures = 0


# -- the summary -------------------------------------------------------------------------------

def load_samples(probe: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (probe / "samples.jsonl").read_text().splitlines() if line.strip()]


def window(samples: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """The samples whose interval lies inside [t0, t1] (a sample covers ``t - dt`` .. ``t``)."""
    return [s for s in samples if s["t"] - s["dt"] >= t0 - 0.05 and s["t"] <= t1 + 0.05]


def machine_shares(ws: list[dict[str, Any]]) -> dict[str, float]:
    """Busy, steal and iowait shares of all CPUs over the samples, and the mean MHz."""
    tot = [sum(col) for col in zip(*(s["cpu"]["cpu"] for s in ws))] if ws else []
    if not tot or not sum(tot):
        return {}
    f = dict(zip(STAT_FIELDS, tot))
    total = sum(tot)
    mhz = [m for s in ws for m in s["mhz"]]
    cg = [s.get("cgroup") or {} for s in (ws[0], ws[-1])]
    throttled = {k: cg[1][k] - cg[0].get(k, cg[1][k]) for k in cg[1] if k.startswith("nr_throttled")}
    return {**throttled, "busy": round(1 - (f["idle"] + f["iowait"] + f["steal"]) / total, 3),
            "steal": round(f["steal"] / total, 4), "iowait": round(f["iowait"] / total, 4),
            "mhz": round(sum(mhz) / len(mhz)) if mhz else None}


def process_shares(ws: list[dict[str, Any]]) -> dict[str, Any]:
    """The vLLM process's CPU (in CPUs), its busiest threads and the busiest other processes."""
    span = sum(s["dt"] for s in ws) or 1.0
    by_proc: Counter = Counter()
    names: dict[int, str] = {}
    threads: Counter = Counter()
    cpus: dict[tuple[int, str], set] = defaultdict(set)
    vllm = None
    for s in ws:
        for p in s["procs"]:
            by_proc[p["pid"]] += p["cpu_s"]
            names[p["pid"]] = f"{p['comm']} {p['cmd'][:60]}"
            if p["vllm"]:
                vllm = p["pid"]
                for tid, comm, used, cpu in p["threads"]:
                    threads[(tid, comm)] += used
                    cpus[(tid, comm)].add(cpu)
    top = [{"pid": pid, "name": names[pid], "cpus": round(c / span, 2)} for pid, c in by_proc.most_common(6)
           if pid != vllm]
    return {"vllm_cpus": round(by_proc[vllm] / span, 2) if vllm else None,
            "vllm_threads": [{"tid": tid, "comm": comm, "cpus": round(c / span, 2), "ran_on": len(cpus[(tid, comm)])}
                             for (tid, comm), c in threads.most_common(4)],
            "others": top}


def spy_functions(probe: Path, t0: float, t1: float, top: int = 6) -> dict[str, Any] | None:
    """py-spy's samples over the chunks starting in [t0, t1): the busiest thread's share of them,
    and its samples' shares by innermost function (``leaf``) and innermost vLLM/xrlhf frame."""
    spy = probe / "pyspy"
    if not spy.is_dir():
        return None
    by_thread: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for f in spy.glob("*.txt"):
        if not t0 - 1.0 <= float(f.stem) < t1:
            continue
        for line in f.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if stack and n.isdigit():
                frames = stack.split(";")
                by_thread[frames[0]].append((frames[1:], int(n)))
    if not by_thread:
        return None
    counts = {t: sum(n for _, n in v) for t, v in by_thread.items()}
    thread = max(counts, key=counts.get)
    leaf, ours = Counter(), Counter()
    for frames, n in by_thread[thread]:
        leaf[frames[-1] if frames else "?"] += n
        mine = [f for f in frames if "vllm/" in f or "xrlhf/" in f]
        ours[mine[-1] if mine else "(none)"] += n
    total = counts[thread]
    share = lambda c: {k: round(v / total, 3) for k, v in c.most_common(top)}  # noqa: E731
    return {"thread": thread, "thread_share": round(total / sum(counts.values()), 3), "samples": total,
            "leaf": share(leaf), "ours": share(ours)}


def load_gc(probe: Path) -> dict[int, list[list]]:
    """Each logged process's collections by pid: ``[start, end, generation, collected]``."""
    out: dict[int, list[list]] = {}
    for f in (probe / "gc").glob("gc-*.jsonl") if (probe / "gc").is_dir() else []:
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out[int(f.stem.rsplit("-", 1)[1])] = rows
    return out


def gc_seconds(collections: list[list], t0: float, t1: float) -> dict[str, float]:
    """Seconds of collection inside [t0, t1], all and of generation 2, and how many."""
    inside = [(max(a, t0), min(b, t1), g) for a, b, g, _ in collections if b > t0 and a < t1]
    return {"gc_s": round(sum(b - a for a, b, _ in inside), 4),
            "gc2_s": round(sum(b - a for a, b, g in inside if g == 2), 4), "gc_n": len(inside)}


def load_canaries(probe: Path) -> dict[int, tuple[list[list], float]]:
    """Each CPU's canary units and their median, by CPU."""
    out = {}
    for f in probe.glob("canary-*.jsonl"):
        units = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        if units:
            ds = sorted(d for _, d in units)
            out[int(f.stem.split("-")[1])] = (units, ds[len(ds) // 2])
    return out


def canary_ratio(canary: list[list], t0: float, t1: float, median: float) -> float | None:
    """The canary's median unit inside [t0, t1] over its median over the whole probe."""
    units = sorted(d for t, d in canary if t0 <= t <= t1)
    return round(units[len(units) // 2] / median, 3) if units and median else None


def canaries(cans: dict[int, tuple[list[list], float]], cpus: set[int], t0: float, t1: float) -> dict[str, Any]:
    """The canary ratio on the CPUs ``cpus`` (the loop thread's) and the median ratio elsewhere."""
    mine = [canary_ratio(u, t0, t1, m) for c, (u, m) in cans.items() if c in cpus]
    rest = sorted(r for c, (u, m) in cans.items() if c not in cpus
                  for r in [canary_ratio(u, t0, t1, m)] if r is not None)
    return {"canary": max((r for r in mine if r is not None), default=None),
            "canary_others": rest[len(rest) // 2] if rest else None}


def loop_cpus(ws: list[dict[str, Any]]) -> set[int]:
    """The CPUs the vLLM process's busiest thread ran on over the samples."""
    used: Counter = Counter()
    cpus: dict[int, set] = defaultdict(set)
    for s in ws:
        for p in s["procs"]:
            if p["vllm"]:
                for tid, _, cpu_s, cpu in p["threads"]:
                    used[tid] += cpu_s
                    cpus[tid].add(cpu)
    return cpus[used.most_common(1)[0][0]] if used else set()


def vllm_pid(samples: list[dict[str, Any]], t0: float, t1: float) -> int | None:
    pids = Counter(p["pid"] for s in window(samples, t0, t1) for p in s["procs"] if p["vllm"])
    return pids.most_common(1)[0][0] if pids else None


def summarize(probe: Path, run_dirs: list[Path]) -> list[dict[str, Any]]:
    samples = load_samples(probe)
    gcs = load_gc(probe)
    cans = load_canaries(probe)
    rows = []
    for run in run_dirs:
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        origin = summary.get("timeline_origin")
        if origin is None:
            print(f"{run}: no timeline_origin in summary.json; skipped", file=sys.stderr)
            continue
        for line in (run / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            for lane, name, a, b in m.get("timeline") or []:
                if lane != "generator":
                    continue
                t0, t1 = origin + a, origin + b
                ws = window(samples, t0, t1)
                pid = vllm_pid(samples, t0, t1)
                rows.append({"run": run.name, "step": m.get("step"), "span": name, "seconds": round(b - a, 3),
                             "samples": len(ws), **machine_shares(ws), **process_shares(ws),
                             **(gc_seconds(gcs[pid], t0, t1) if pid in gcs else {}),
                             **canaries(cans, loop_cpus(ws), t0, t1),
                             "spy": spy_functions(probe, t0, t1)})
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        th = ", ".join(f"{t['comm']} {t['cpus']} on {t['ran_on']}" for t in r.get("vllm_threads", []))
        others = ", ".join(f"{o['name'][:30]} {o['cpus']}" for o in r.get("others", [])[:3])
        print(f"{r['run']} step {r['step']} {r['span']}: {r['seconds']} s | busy {r.get('busy')} steal "
              f"{r.get('steal')} throttled {r.get('nr_throttled')} canary {r.get('canary')} (others {r.get('canary_others')}) gc {r.get('gc_s')} s "
              f"(gen 2: {r.get('gc2_s')}, {r.get('gc_n')}) | vLLM {r.get('vllm_cpus')} CPUs: {th} | {others}")
        if r.get("spy"):
            sp = r["spy"]
            print(f"    py-spy {sp['thread']} ({sp['thread_share']} of samples): leaf "
                  + ", ".join(f"{k} {v}" for k, v in sp["leaf"].items()))
            print("      ours: " + ", ".join(f"{k} {v}" for k, v in sp["ours"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="the probe's folder (samples.jsonl, pyspy/)")
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument("--pyspy", type=float, default=0.0, help="py-spy chunks of this many seconds (0: none)")
    p.add_argument("--summarize", nargs="+", type=Path, metavar=("PROBE", "RUN_DIR"))
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.summarize:
        probe, runs = args.summarize[0], args.summarize[1:]
        rows = summarize(probe, runs)
        print_rows(rows)
        (probe / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd or args.out is None:
        p.error("give --out DIR -- CMD ..., or --summarize PROBE RUN_DIR ...")
    sampler = Sampler(args.out, args.interval, args.pyspy).start()
    from xrlhf.engines.host import GC_LOG_ENV

    try:
        return subprocess.call(cmd, env={**os.environ, GC_LOG_ENV: str(args.out / "gc")})
    finally:
        sampler.stop()


if __name__ == "__main__":
    sys.exit(main())
