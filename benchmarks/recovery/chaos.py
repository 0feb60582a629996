"""Chaos: runs SIGKILLed at random moments and resumed end as if nothing had happened (issue 49).

For each config of ``CONFIGS`` (the quickstart, one-step-off GRPO with dynamic sampling, the
calculator-tool episode run; each shortened for a CPU), one uninterrupted run is the reference.
Then, for each moment of ``MOMENTS``, the same run is started, SIGKILLed (its whole process
group) at a random point of that moment, and resumed with ``--resume`` to its end. A kill passes
when:

* it landed in its moment (read back from the run's ``train.log`` and checkpoint directory);
* no process of the run is left ``--grace`` seconds after it: the driver's process tree as it
  was just before the kill (Ray's own processes, the workers, tool sandboxes), and any process
  of its Ray session;
* the resume exits 0 with the reference's final weights (``final/model.safetensors``, tensor by
  tensor), every RL step logged once, and each prompt trained on as often as in the reference
  (the multiset of every step's ``prompts`` in ``metrics.jsonl``: the prompt index of each group
  it trained on).

The moments, as seen from outside the run (``train.log`` is written at DEBUG: the trainer's
phases begin with ``trainer: <phase> begins`` lines, the rollout's rounds with ``rollout: batch
B ...`` lines):

    start-up     the Ray start-up: "starting Ray and the workers" .. "Ray handles ready"
    warm-up      the supervised warm-up: "warm-up: N SFT steps" .. "warm-up step N/N"
    rollout      batch B's generation (B after the first checkpoint): "rollout: batch B round 0"
                 .. "rollout: batch B generated"
    update       step S's update (S after the first checkpoint): its "trainer: update begins" ..
                 the trainer's next wait or sync
    checkpoint   checkpoint step C (any but the last step's) being written: while its temporary
                 directory exists

A kill waits for its moment's start, then a random 10-60% of the moment's length in the
reference run (seeded by ``--seed``, the config and the moment, so a failure reruns the same
way); a kill that missed its moment (the run was quicker this time) is tried again, up to
``--tries`` times.

    python -m benchmarks.recovery chaos --out benchmarks/results       # 3 configs x 5 moments, ~25 minutes on 2 cores
    python -m benchmarks.recovery chaos --configs quickstart --moments update,rollout

Writes ``chaos.json`` (every kill: where it landed, what it left, what the resume found) and
``chaos.md`` (the table of docs/healing.md) under ``--out``; the runs go under ``--work``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MOMENTS = ("start-up", "warm-up", "rollout", "update", "checkpoint")

SHORT = ["trainer.steps=8", "trainer.eval_every=4", "trainer.eval_size=16", "checkpoint.every=2"]
"""Every config: 8 RL steps, a checkpoint every 2, an evaluation at step 4 on 16 prompts."""

CONFIGS: dict[str, tuple[str, list[str]]] = {
    "quickstart": ("configs/quickstart.yaml", [*SHORT, "warmup.steps=30"]),
    "grpo_async": ("configs/grpo_async.yaml", [*SHORT, "warmup.steps=40",
                                               "rollout.refill={name: dynamic_sampling, max_generated_factor: 3.0}"]),
    "tool_calc": ("configs/tool_calc.yaml", [*SHORT, "warmup.steps=80", "warmup.batch_size=32", "warmup.lr=3e-3",
                                             "env.options.sft_tool_fraction=1.0", "env.options.tools=[{name: calculator, options: {sandbox: auto}}]",
                                             "algorithm.entropy_coef=0.01"]),
}
"""Each config with the overrides that make it a CPU run of a minute or two on the tiny model
(``policy.model`` is added). grpo_async: 40 warm-up steps give rewards that differ within some
groups, so dynamic sampling keeps some and generates more rounds for the rest. tool_calc: every
warm-up demonstration calls the calculator, so the policy calls it in about 40% of its episodes,
each call in a sandboxed tool process (``sandbox: auto``; the shipped calculator runs in the
trainer's process), whose processes a kill must not leave behind either; the tiny model never
gets a product right (reward 0, no advantage), so an entropy bonus makes every update depend on
what was sampled."""


@dataclass
class Moment:
    """Where a kill aims: after the ``nth`` line of ``train.log`` matching ``start`` and before a
    later line matching ``end``; or, with ``tmp``, while the temporary directory of checkpoint
    ``tmp`` exists."""

    name: str
    where: str
    start: str | None = None
    end: str | None = None
    nth: int = 1
    tmp: str | None = None


def aim(moment: str, steps: int, every: int, warmup: int, rng: random.Random) -> Moment:
    """The ``Moment`` of kind ``moment`` in a run of ``steps`` RL steps, a checkpoint every
    ``every`` and ``warmup`` warm-up steps; the batch, step or checkpoint drawn from ``rng``."""
    if moment == "start-up":
        return Moment(moment, "the Ray start-up", r"starting Ray and the workers", r"Ray handles ready")
    if moment == "warm-up":
        return Moment(moment, f"the warm-up ({warmup} steps)", r"warm-up: \d+ SFT steps",
                      rf"warm-up step {warmup}/{warmup}\b")
    if moment == "rollout":
        b = rng.randint(every + 1, steps - 1)
        return Moment(moment, f"batch {b}'s generation", rf"rollout: batch {b} round 0:", rf"rollout: batch {b} generated")
    if moment == "update":
        s = rng.randint(every + 1, steps - 1)
        return Moment(moment, f"step {s}'s update", r"trainer: update begins", r"trainer: (wait|sync) begins", nth=s)
    if moment == "checkpoint":
        c = rng.choice(range(every, steps, every))
        return Moment(moment, f"checkpoint step {c}'s writing", tmp=f"step-{c:08d}")
    raise ValueError(f"moment {moment!r}: choose from {', '.join(MOMENTS)}")


class Watch:
    """A run seen from outside: the lines of its ``train.log`` as they are written, and the
    temporary directories of the checkpoints being written (``tmp``: name -> first and last
    time seen, monotonic)."""

    def __init__(self, out: Path):
        self.out = out
        self.lines: list[str] = []
        self.tmp: dict[str, list[float]] = {}
        self.tmp_now: set[str] = set()
        self._offset, self._rest = 0, b""

    def poll(self) -> None:
        try:
            with open(self.out / "train.log", "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            data = b""
        self._offset += len(data)
        *done, self._rest = (self._rest + data).split(b"\n")
        self.lines += [x.decode(errors="replace") for x in done]
        try:
            self.tmp_now = {n for n in os.listdir(self.out / "checkpoints") if n.startswith(".tmp-")}
        except OSError:
            self.tmp_now = set()
        now = time.monotonic()
        for n in self.tmp_now:
            self.tmp.setdefault(n, [now, now])[1] = now

    def find(self, pattern: str, nth: int = 1, start: int = 0) -> int | None:
        """The index of the ``nth`` line from ``start`` on that matches ``pattern``."""
        for i in range(start, len(self.lines)):
            if re.search(pattern, self.lines[i]):
                nth -= 1
                if nth == 0:
                    return i
        return None

    def tmp_of(self, name: str) -> list[str]:
        return [n for n in self.tmp if n.startswith(f".tmp-{name}-")]


def stamp(line: str) -> float:
    """The time of a ``train.log`` line (loguru's ``2026-11-28 19:46:38.812 | ...``), in seconds."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()


def window(ref: Watch, m: Moment) -> float:
    """How long moment ``m`` lasted in the reference run (seconds; a floor of 20 ms)."""
    if m.tmp is not None:
        seen = [ref.tmp[n] for n in ref.tmp_of(m.tmp)]
        return max([0.02] + [last - first for first, last in seen])
    i = ref.find(m.start, m.nth)
    j = ref.find(m.end, 1, i + 1) if i is not None else None
    if j is None:
        raise RuntimeError(f"the reference run never went through {m.where} ({m.start!r} .. {m.end!r})")
    return max(0.02, stamp(ref.lines[j]) - stamp(ref.lines[i]))


def landed(w: Watch, m: Moment) -> bool:
    """Whether a run killed while aiming at ``m`` died inside it (its log and files, read after the kill)."""
    w.poll()
    if m.tmp is not None:
        return any(n.startswith(f".tmp-{m.tmp}-") for n in w.tmp_now) and not (w.out / "checkpoints" / m.tmp).exists()
    i = w.find(m.start, m.nth)
    return i is not None and w.find(m.end, 1, i + 1) is None


def command(config: str, overrides: list[str], out: Path, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "xrlhf.cli", "run", str(ROOT / config), *overrides, "--output-dir", str(out),
            *(["--resume"] if resume else [])]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """``cmd`` in a session of its own (its process group is the run's), output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


def finish(proc: subprocess.Popen, watch: Watch | None, timeout: float) -> int:
    """Wait for ``proc`` (polling ``watch`` meanwhile); SIGKILL its group after ``timeout`` s (exit -9)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        if watch is not None:
            watch.poll()
        time.sleep(0.005 if watch is not None else 0.2)
    if watch is not None:
        watch.poll()
    return proc.returncode


def wait_for(proc: subprocess.Popen, w: Watch, m: Moment, delay: float, timeout: float) -> float | None:
    """Wait until moment ``m`` began, then ``delay`` s more; returns when it began (monotonic), or
    ``None`` when the run ended (or ``timeout`` passed) before."""
    deadline, began, seen, hits = time.monotonic() + timeout, None, 0, 0
    while time.monotonic() < deadline and proc.poll() is None:
        w.poll()
        if began is None and m.tmp is not None and any(n.startswith(f".tmp-{m.tmp}-") for n in w.tmp_now):
            began = time.monotonic()
        elif began is None and m.tmp is None:
            hits += sum(1 for line in w.lines[seen:] if re.search(m.start, line))
            seen = len(w.lines)
            began = time.monotonic() if hits >= m.nth else None
        if began is not None:
            left = began + delay - time.monotonic()
            if left <= 0:
                return began
            time.sleep(min(left, 0.002))
        else:
            time.sleep(0.002)
    return None


def kill_group(proc: subprocess.Popen) -> list[tuple[Any, float, str]]:
    """SIGKILL the run's process group; returns its process tree just before: ``(process,
    create time, name)`` of the driver and every descendant."""
    import psutil

    tree = []
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            tree.append((p, p.create_time(), p.name()))
        except psutil.Error:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return tree


def _alive(p, created: float) -> bool:
    import psutil

    try:
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _session(pid: int) -> list:
    """Processes of the Ray session a driver of pid ``pid`` started (its directory ends ``_<pid>``)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(f"_{pid}/" in part or part.endswith(f"_{pid}") for part in (p.info["cmdline"] or [])):
            found.append(p)
    return found


def leftovers(tree: list[tuple[Any, float, str]], driver: int, grace: float) -> tuple[list[str], float | None]:
    """The run's processes (``tree`` and its Ray session) alive ``grace`` s after the kill, which
    are then killed here; and how long the last one took to go (``None``: some were left)."""
    t0 = time.monotonic()
    while True:
        alive = [(p, name) for p, created, name in tree if _alive(p, created)]
        alive += [(p, p.name()) for p in _session(driver) if p.pid not in {q.pid for q, _ in alive}]
        if not alive:
            return [], round(time.monotonic() - t0, 2)
        if time.monotonic() - t0 > grace:
            break
        time.sleep(0.1)
    import psutil

    left = []
    for p, name in alive:
        with contextlib.suppress(psutil.Error):  # (gone meanwhile)
            left.append(f"{name} (pid {p.pid}: {' '.join(p.cmdline())[:120]})")
            p.kill()  # a process this harness started: the run's own
    return left, None


def weights_digest(out: Path) -> str | None:
    """sha256 over the final policy's tensors (name, dtype, shape, bytes), in name order."""
    import torch
    from safetensors.torch import load_file

    path = out / "final" / "model.safetensors"
    if not path.is_file():
        return None
    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trained(out: Path) -> tuple[list[int], Counter]:
    """The RL steps logged in ``metrics.jsonl`` (in order) and the multiset of the prompts they
    trained on (each step's ``prompts``)."""
    rows = []
    if (out / "metrics.jsonl").is_file():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    steps = [r for r in rows if "prompts" in r and "step" in r]
    return [r["step"] for r in steps], Counter(i for r in steps for i in r["prompts"])


@dataclass
class Job:
    """One config's runs: its YAML and overrides (the model's included), its shape, where its runs go."""

    name: str
    config: str
    overrides: list[str]
    steps: int
    every: int
    warmup: int
    work: Path
    timeout: float

    @classmethod
    def of(cls, name: str, model: str, work: Path, timeout: float, extra: tuple[str, ...] = ()) -> Job:
        from xrlhf.validation import load_config

        config, over = CONFIGS[name]
        overrides = [*over, *extra, f"policy.model={model}"]
        cfg = load_config(ROOT / config, overrides)
        return cls(name, config, overrides, cfg.trainer.steps, cfg.checkpoint.every, cfg.warmup.steps, work / name,
                   timeout)


def reference(job: Job) -> tuple[Watch, dict[str, Any]]:
    """The uninterrupted run, watched (the moments' lengths come from it): its final weights'
    digest, RL steps and trained prompts."""
    out, log = job.work / "reference" / "run", job.work / "reference" / "run.log"
    shutil.rmtree(out.parent, ignore_errors=True)
    watch, t0 = Watch(out), time.monotonic()
    code = finish(start(command(job.config, job.overrides, out), log), watch, job.timeout)
    if code != 0:
        raise RuntimeError(f"{job.name}: the uninterrupted run exited {code}:\n{tail(log)}")
    steps, prompts = trained(out)
    if not prompts:
        raise RuntimeError(f"{job.name}: {out}/metrics.jsonl records no trained prompts (the steps' 'prompts')")
    return watch, {"seconds": round(time.monotonic() - t0, 1), "weights": weights_digest(out), "steps": steps,
                   "prompts": prompts}


def kill(job: Job, m: Moment, delay: float, tag: str, grace: float) -> dict[str, Any]:
    """Start the run in ``<work>/<tag>``, SIGKILL its process group ``delay`` s into moment ``m``,
    and look at what the kill left: whether it landed in ``m``, the processes still alive."""
    out, log = job.work / tag / "run", job.work / tag / "run.log"
    shutil.rmtree(out.parent, ignore_errors=True)
    watch, t0 = Watch(out), time.monotonic()
    proc = start(command(job.config, job.overrides, out), log)
    began = wait_for(proc, watch, m, delay, job.timeout)
    result: dict[str, Any] = {"out": str(out), "where": m.where, "delay_s": delay, "landed": False, "left": []}
    if began is None:
        code = proc.poll()
        if code is None:
            kill_group(proc)
        result["why"] = [f"{m.where} never came (the run {'ended, exit ' + str(code) if code is not None else 'timed out'})"]
        return result
    tree = kill_group(proc)
    result.update(killed_after_s=round(time.monotonic() - t0, 1), landed=landed(watch, m), processes=len(tree),
                  tree=dict(Counter(name for _, _, name in tree)))
    result["left"], result["gone_after_s"] = leftovers(tree, proc.pid, grace)
    result["log_lines"] = len(watch.lines)
    return result


def resumed_from(lines: list[str]) -> str:
    """Where a resume's log says it went on from: a checkpoint's name, or ``the start``."""
    for line in lines:
        found = re.search(r"(?:resuming from |continuing after step \d+ \()\S*?((?:step|warmup)-\d{8})", line)
        if found:
            return found.group(1)
        if "from scratch" in line or "starting it again" in line:
            return "the start"
    return "?"


def resume(job: Job, killed: dict[str, Any], ref: dict[str, Any], grace: float) -> dict[str, Any]:
    """``--resume`` the killed run to its end; compare it with the reference. Adds ``passed`` and,
    for a failure, ``why`` (every reason) to ``killed``."""
    out = Path(killed["out"])
    t0 = time.monotonic()
    code = finish(start(command(job.config, job.overrides, out, resume=True), out.parent / "resume.log"), None,
                  job.timeout)
    log = out / "train.log"
    lines = log.read_text(errors="replace").splitlines()[killed.get("log_lines", 0):] if log.is_file() else []
    steps, prompts = trained(out)
    digest = weights_digest(out)
    why = list(killed.get("why", []))
    if not killed["landed"] and not why:
        why.append(f"the kill missed {killed['where']} (it was over)")
    if killed["left"]:
        why.append(f"{len(killed['left'])} process(es) alive {grace:g} s after the kill: " + "; ".join(killed["left"]))
    if code != 0:
        why.append(f"--resume exited {code}: {tail(out.parent / 'resume.log', 600)}")
    if digest != ref["weights"]:
        why.append("no final weights" if digest is None else "final weights differ from the uninterrupted run's")
    if steps != ref["steps"]:
        why.append(f"RL steps logged {steps}, the uninterrupted run {ref['steps']}")
    lost, replayed = ref["prompts"] - prompts, prompts - ref["prompts"]
    if lost or replayed:
        why.append(f"prompts trained on: {sum(lost.values())} times fewer, {sum(replayed.values())} more than "
                   f"uninterrupted (e.g. lost {sorted(lost)[:5]}, replayed {sorted(replayed)[:5]})")
    return {**killed, "resume_exit": code, "resume_s": round(time.monotonic() - t0, 1),
            "resumed_from": resumed_from(lines), "weights_identical": digest == ref["weights"],
            "steps_once": steps == ref["steps"], "prompts_equal": not lost and not replayed,
            "prompts_lost": sum(lost.values()), "prompts_replayed": sum(replayed.values()),
            "passed": not why, "why": why}


def chaos(name: str, moments: list[str], work: Path, model: str, seed: int = 0, tries: int = 3,
          grace: float = 15.0, timeout: float = 900, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Config ``name`` (with the overrides ``extra`` after its own): its uninterrupted run, then one
    kill and resume per moment of ``moments`` (each tried again up to ``tries`` times while it misses
    its moment). Returns the reference's figures and each kill's (``resume``'s dict)."""
    job = Job.of(name, model, work, timeout, extra)
    ref_watch, ref = reference(job)
    kills = []
    for moment in moments:
        rng = random.Random(f"{seed}:{name}:{moment}")
        for attempt in range(1, tries + 1):
            m = aim(moment, job.steps, job.every, job.warmup, rng)
            length = window(ref_watch, m)
            delay = round(length * rng.uniform(0.1, 0.6), 3)
            killed = {**kill(job, m, delay, f"{moment}-{attempt}", grace), "window_s": round(length, 3)}
            if killed["landed"] or attempt == tries:
                break
            print(f"{name} / {moment}: try {attempt} missed {m.where} ({delay} s in); again", flush=True)
        row = {"config": name, "moment": moment, "tries": attempt, **resume(job, killed, ref, grace)}
        row["seconds"] = round(row.get("killed_after_s", 0) + row["resume_s"], 1)
        print(f"{name} / {moment}: {'pass' if row['passed'] else 'FAIL'} ({row['where']}, {delay} s in)"
              + "".join(f"\n    {w}" for w in row["why"]), flush=True)
        kills.append(row)
    summary = {k: v for k, v in ref.items() if k != "prompts"}
    summary.update(prompts_total=sum(ref["prompts"].values()), prompts_distinct=len(ref["prompts"]))
    return {"config": name, "command": " ".join(command(job.config, job.overrides, Path("OUT"))[3:]),
            "reference": summary, "kills": kills}


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of every kill: config x moment."""
    lines = ["| config | moment | killed in | processes left | resumed from | final weights | prompts | result | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for k in r["kills"]:
            left = (f"none ({k['gone_after_s']} s)" if k.get("gone_after_s") is not None
                    else f"**{len(k['left'])}**" if k["left"] else "-")
            prompts = ("same" if k["prompts_equal"] else
                       f"**{k['prompts_lost']} lost, {k['prompts_replayed']} replayed**")
            tries = f" (try {k['tries']})" if k["tries"] > 1 else ""
            lines.append(f"| {r['config']} | {k['moment']} | {k['where']}, {k['delay_s']} s in{tries}"
                         f"{'' if k['landed'] else ' (missed)'} | {left} | {k['resumed_from']} | "
                         f"{'identical' if k['weights_identical'] else '**differ**'} | {prompts} | "
                         f"{'pass' if k['passed'] else '**FAIL**'} | {k['seconds']} |")
    return "\n".join(lines)


def ensure_model(path: str) -> str:
    """The tiny char model at ``path`` (built as ``make quickstart`` builds it when missing); absolute."""
    from xrlhf.models.tiny import build_model

    model = Path(path) if Path(path).is_absolute() else ROOT / path
    if not (model / "config.json").is_file():
        build_model(model)
    return str(model)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.recovery chaos", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="where chaos.json and chaos.md go")
    ap.add_argument("--work", default="/tmp/xrlhf-chaos", help="where the runs go (emptied per run)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--moments", default=",".join(MOMENTS), help=f"of {', '.join(MOMENTS)}")
    ap.add_argument("--seed", type=int, default=0, help="draws each kill's batch, step and delay")
    ap.add_argument("--tries", type=int, default=3, help="kills per moment while they miss it")
    ap.add_argument("--grace", type=float, default=15.0, help="seconds the run's processes have to be gone")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    ap.add_argument("--model", default="artifacts/tiny-char", help="the tiny char model (built if missing)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[2:] if argv is None else list(argv)
    names, moments = args.configs.split(","), args.moments.split(",")
    bad = [n for n in names if n not in CONFIGS] + [m for m in moments if m not in MOMENTS]
    if bad:
        ap.error(f"unknown: {', '.join(bad)} (configs: {', '.join(CONFIGS)}; moments: {', '.join(MOMENTS)})")
    model, t0, load = ensure_model(args.model), time.time(), os.getloadavg()
    results = [chaos(n, moments, Path(args.work), model, args.seed, args.tries, args.grace, args.timeout)
               for n in names]
    report = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", "-m", "benchmarks.recovery",
                                                                                     "chaos", *args.argv]),
              "machine": f"{platform.node()}: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})",
              "load_average_at_start": [round(x, 2) for x in load], "seed": args.seed, "grace_s": args.grace,
              "wall_s": round(time.time() - t0), "passed": sum(k["passed"] for r in results for k in r["kills"]),
              "kills": sum(len(r["kills"]) for r in results), "configs": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(report, indent=1) + "\n")
    md = table(results)
    (out / "chaos.md").write_text(f"{report['date']}, {report['machine']}, load average {load[0]:.1f} at the start; "
                                  f"`{report['command']}` ({report['wall_s'] / 60:.0f} min): {report['passed']}/"
                                  f"{report['kills']} passed.\n\n{md}\n")
    print(md)
    sys.exit(0 if report["passed"] == report["kills"] else 1)

