"""Shared pieces of the benchmarks: the machine, the model, vLLM settings, JSON and tables, and one
run of a config with the learning figures read off its metrics (the learning benchmarks, CPU and GPU)."""

from __future__ import annotations

import atexit
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from loguru import logger

ROOT = Path(__file__).resolve().parents[1]
MODEL_05B = ROOT / "artifacts" / "model-0.5b"


def gpu_name() -> str:
    """The first GPU's name and memory, e.g. ``NVIDIA H100 80GB HBM3 (79.2 GiB) x1``."""
    import torch

    if not torch.cuda.is_available():
        return "none"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} ({p.total_memory / 2**30:.1f} GiB) x{torch.cuda.device_count()}"


def gpu_label() -> str:
    """nvidia-smi's name and memory of the first GPU (``none`` without one); no CUDA context."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "none"
    return names.strip()


def host_label() -> str:
    """The host's CPU model and count, e.g. ``AMD EPYC 9654 96-Core Processor x16`` (from
    ``/proc/cpuinfo``; ``unknown`` where it has no model name): a host-bound step's speed moves
    with it, so each GPU row names it beside the card."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown'} x{os.cpu_count()}"


def ensure_model(path: str | Path = MODEL_05B, preset: str = "0.5b", dtype: str = "bfloat16") -> str:
    """The locally built model at ``path`` (built from ``preset`` if missing); absolute path."""
    from xrlhf.models.tiny import PRESETS, build_model

    path = Path(path)
    if not (path / "config.json").is_file():
        build_model(path, **PRESETS[preset], dtype=dtype)
    return str(path.resolve())


def model_params(path: str) -> int:
    from xrlhf.models.tiny import count_params

    return count_params(path)


def vllm_options(**fields) -> dict[str, Any]:
    """``EngineSpec.options`` for a vLLM engine: ``fields`` + the JSON in ``XRLHF_VLLM``."""
    from xrlhf.engines.vllm import VLLMOptions  # light: vLLM is imported only to build an engine

    over = json.loads(os.environ.get("XRLHF_VLLM") or "{}")
    engine_options = {**fields.pop("engine_options", {}), **over.pop("engine_options", {})}
    return VLLMOptions(engine="vllm", **{**fields, **over}, engine_options=engine_options).model_dump()


def cli_overrides() -> list[str]:
    """``XRLHF_VLLM`` as ``policy.generate.<field>=<value>`` overrides of a YAML config."""
    over = json.loads(os.environ.get("XRLHF_VLLM") or "{}")
    return [f"policy.generate.{k}={json.dumps(v)}" for k, v in over.items()]


def write_json(out_dir: str | Path, name: str, data: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {**data, "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "versions": versions()}
    path = out / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def versions() -> dict[str, str]:
    out = {}
    for mod in ("torch", "vllm", "transformers", "ray"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - reporting only
            pass
    return out


def trl_env(site: str | None, gpus: int = 1) -> dict[str, str]:
    """The environment of TRL's process: the first ``gpus`` of the visible GPUs and, with ``site``,
    TRL's own stack (a ``pip --target`` folder: TRL on a vLLM release it supports, with that
    vLLM's torch) in place of xrlhf's. The repository stays importable (``trl_grpo.py`` builds
    W's prompts and reward from ``xrlhf.envs``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus))))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(visible.split(",")[:gpus]))
    if site is None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        return env
    if not (Path(site) / "trl").is_dir():
        raise SystemExit(f"--trl-site: {site} holds no trl package; install TRL's stack there "
                         "(benchmarks/stage_stack.sh trl, then gpu.sh setup) or leave the option out")
    env["PYTHONPATH"] = os.pathsep.join([site, str(ROOT)])
    env["PATH"] = os.pathsep.join([str(Path(site) / "bin"), env.get("PATH", "")])
    return env


def table(rows: Iterable[Iterable[Any]], header: Iterable[str]) -> str:
    """A plain text table (what each benchmark prints at the end)."""
    rows = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    header = list(header)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


CLOCK_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
"""What the sampler also reads where the driver knows these names: SM clock (MHz), board power (W),
temperature (C) and the bitmask of why the clocks are held down."""
SLOWDOWN_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""Of ``clocks_event_reasons``: power cap, hardware slowdown, software and hardware thermal
slowdown, power brake (idle and the application's clock setting are not slowdowns)."""


class DeviceMemorySampler:
    """The GPU's used memory and utilisation sampled by ``nvidia-smi`` every ``period_ms`` (no CUDA
    context in this process, so it perturbs nothing): ``peak()`` memory in GiB and mean
    ``utilization()`` in % (the share of time a kernel ran, as the driver reports it), both since
    the last ``reset()``. A utilisation well under 100% while generating means the host, not the
    GPU, sets the pace. Where the driver has them, each sample also holds ``CLOCK_FIELDS``, and
    ``window(t0, t1)`` gives their means over a span of wall-clock time (``time.time()``): whether
    the GPU ran slower in one phase than in another."""

    def __init__(self, gpu: int | None = None, period_ms: int = 50):
        """``gpu``: nvidia-smi's index; default the first of ``CUDA_VISIBLE_DEVICES`` (else 0)."""
        import threading

        if gpu is None:
            gpu = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
        fields = ["memory.used", "utilization.gpu", *CLOCK_FIELDS]
        probe = subprocess.run(["nvidia-smi", f"--id={gpu}", f"--query-gpu={','.join(fields)}",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:  # an older driver without one of the names: memory and busy alone
            fields = fields[:2]
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--id={gpu}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
             f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self._peak = 0.0
        self._util: list[float] = []
        self._samples: list[tuple[float, ...]] = []  # (time, sm MHz, W, C, slowed 0/1)
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [x.strip() for x in line.split(",")]
            try:
                mib, util = float(parts[0]), float(parts[1])
            except (ValueError, IndexError):
                continue
            sample = None
            if len(parts) == 2 + len(CLOCK_FIELDS):
                try:
                    sample = (time.time(), float(parts[2]), float(parts[3]), float(parts[4]),
                              float(bool(int(parts[5], 16) & SLOWDOWN_BITS)))
                except ValueError:  # [N/A] on this board
                    pass
            with self._lock:
                self._peak = max(self._peak, mib / 1024)
                self._util.append(util)
                if sample is not None:
                    self._samples.append(sample)

    def reset(self) -> None:
        with self._lock:
            self._peak = 0.0
            self._util = []
            self._samples = []

    def peak(self) -> float:
        with self._lock:
            return self._peak

    def utilization(self) -> float | None:
        with self._lock:
            return round(sum(self._util) / len(self._util), 1) if self._util else None

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Means over the samples taken in ``[t0, t1)`` (wall clock): ``sm_mhz``, ``power_w``,
        ``temp_c`` and ``slowed`` (the share of samples with a slowdown reason); empty without
        such samples."""
        with self._lock:
            rows = [s for s in self._samples if t0 <= s[0] < t1]
        if not rows:
            return {}
        n = len(rows)
        return {k: round(sum(r[i] for r in rows) / n, 3 if k == "slowed" else 1)
                for i, k in enumerate(("sm_mhz", "power_w", "temp_c", "slowed"), start=1)}

    def close(self) -> None:
        self.proc.terminate()


# -- one run of a config and its learning figures ------------------------------------------------
def save_figure(fig, ax, path: Path) -> Path:
    """A curve plot's finish (grid, legend) written to ``path`` as PNG; the figure is closed."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rl_clock(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> the RL clock at its end: the sum of ``time/step_s`` up to it (0 before RL)."""
    clock, t = {0: 0.0}, 0.0
    for r in rows:
        if r.get("step", 0) >= 1 and "time/step_s" in r:
            t += r["time/step_s"]
            clock[r["step"]] = round(t, 2)
    return clock


def curve(rows: list[dict[str, Any]], samples_per_step: int) -> list[dict[str, Any]]:
    """The eval points of a run: step, samples seen, eval reward and the RL clock."""
    clock = rl_clock(rows)
    return [{"step": r["step"], "samples": r["step"] * samples_per_step, "eval_reward": r["eval/reward_mean"],
             "rl_s": clock.get(r["step"], max(clock.values()))}
            for r in rows if "eval/reward_mean" in r and "step" in r]


def time_to_reach(points: list[dict[str, Any]], target: float) -> float | None:
    """The RL clock of the first eval point at or above ``target`` (None if none is)."""
    return next((p["rl_s"] for p in points if p["eval_reward"] >= target), None)


def compile_excess(curve: list[dict[str, Any]]) -> float:
    """Seconds by which a curve's first eval interval outlasts its second: the first steps' one-off
    cost (the first RL run on a machine compiles the trainer's graphs; a later one reads inductor's
    cache), so that runs in another order compare on the same clock."""
    if len(curve) < 3:
        return 0.0
    a, b, c = (p["rl_s"] for p in curve[:3])
    return round(max(0.0, (b - a) - (c - b)), 2)


def steady(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The curve on the RL clock without its ``compile_excess`` (step 0 stays at 0 s)."""
    x = compile_excess(curve)
    return [{**p, "rl_s": round(max(0.0, p["rl_s"] - x), 2)} if i else p for i, p in enumerate(curve)]


def at_or_above(curve: list[dict[str, Any]], ref: list[dict[str, Any]]) -> float | None:
    """The share of ``curve``'s evals after step 0 at or above ``ref``'s latest eval at that clock
    (both steady): 1.0 is a curve that never falls below the reference's against wall-clock."""
    pts, ref = steady(curve)[1:], steady(ref)
    if not pts:
        return None
    hits = [p["eval_reward"] >= max((q for q in ref if q["rl_s"] <= p["rl_s"]), key=lambda q: q["rl_s"],
                                    default=ref[0])["eval_reward"] for p in pts]
    return round(sum(hits) / len(hits), 3)


def stats(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for one value)."""
    if not xs:
        return None, None
    return round(statistics.mean(xs), 4), round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0


def run_one(path: Path, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One run of ``path`` with ``overrides`` in ``run_dir``, in this process: its figures (eval
    before and after, wall and RL seconds, the eval curve, the train reward; ``error`` if it failed)."""
    from xrlhf.report import read_metrics
    from xrlhf.runner import run
    from xrlhf.validation import load_config

    cfg = load_config(path, overrides)
    per_step = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    t0 = time.time()
    error, summary = None, {}
    try:
        summary = run(cfg, run_dir)
    except Exception as e:  # noqa: BLE001 - recorded, the next run still goes
        error = f"{type(e).__name__}: {e}"
        import traceback

        traceback.print_exc()
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    stale = [r["staleness/mean"] for r in steps if "staleness/mean" in r]
    clock = rl_clock(rows)
    return {"steps": cfg.trainer.steps, "samples_per_step": per_step, "overrides": overrides,
            "eval_initial": summary.get("eval_reward_initial"), "eval_final": summary.get("eval_reward_final"),
            "eval_before_warmup": summary.get("eval_reward_before_warmup"),
            "wall_s": round(time.time() - t0, 1), "rl_s": round(sum(r["time/step_s"] for r in steps), 1),
            "staleness_mean": round(statistics.mean(stale), 3) if stale else None,
            "reward_train_last": steps[-1]["reward/mean"] if steps else None,
            "curve": curve(rows, per_step),
            "train_reward": [[r["step"], clock[r["step"]], r["reward/mean"]] for r in steps],
            "run_dir": str(run_dir), "error": error}


# -- diagnostics inside a run's workers, through xrlhf's worker set-up hook ---------------------------
# ``XRLHF_WORKER_SETUP=benchmarks.common:worker_diagnostics`` (``engines.host.SETUP_ENV``; the
# repository root on ``PYTHONPATH``, as gpu.sh has it) and one or both of:
# * ``XRLHF_PROFILE_SETUP=DIR``: each engine's build and each ``preload``'s imports under cProfile,
#   their tables in ``DIR/<handle>-<rank>-<role>[-preload].txt``: where a start-up's seconds go, in
#   the workers themselves (``benchmarks.startup``'s ``warm-profile``);
# * ``XRLHF_GC_LOG=DIR``: every garbage collection of each worker's process (epoch start and end,
#   generation, objects collected) in ``DIR/gc-<handle>-<rank>-<pid>.jsonl``: whether Python's
#   collector is in a phase's seconds, lined up with the steps' timelines (``summary.json``'s
#   ``timeline_origin``; docs/design/probes.md).
WORKER_SETUP = "benchmarks.common:worker_diagnostics"
PROFILE_ENV = "XRLHF_PROFILE_SETUP"
GC_LOG_ENV = "XRLHF_GC_LOG"


def diagnostics_env(profile_dir: str | None = None, gc_dir: str | None = None) -> dict[str, str]:
    """The environment that turns these diagnostics on in a run's workers."""
    out = {"XRLHF_WORKER_SETUP": WORKER_SETUP}
    if profile_dir:
        out[PROFILE_ENV] = profile_dir
    if gc_dir:
        out[GC_LOG_ENV] = gc_dir
    return out


def worker_diagnostics(host: Any) -> None:
    """The worker set-up hook: the diagnostics the variables above name, for ``host`` (an
    ``engines.host.EngineHost``)."""
    if os.environ.get(GC_LOG_ENV):
        log_gc(os.environ[GC_LOG_ENV], f"{host.handle}-{host.rank}")
    if os.environ.get(PROFILE_ENV):
        host.around = profiler(os.environ[PROFILE_ENV])


def profiler(folder: str) -> Callable[..., Any]:
    """``around(what, fn, *args)`` for ``EngineHost``: ``fn(*args)`` under cProfile, the tables
    written to ``<folder>/<what>.txt`` even if ``fn`` raises."""

    def around(what: str, fn: Callable[..., Any], *args: Any) -> Any:
        prof = cProfile.Profile()
        try:
            return prof.runcall(fn, *args)
        finally:
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("cumulative").print_stats(80)
            stats.sort_stats("tottime").print_stats(40)
            try:
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, f"{what}.txt"), "w") as f:
                    f.write(text.getvalue())
            except OSError as e:  # a diagnostic: the build's own result or error comes first
                logger.warning(f"{PROFILE_ENV}={folder}: cannot write the profile of {what} ({e})")

    return around


def log_gc(folder: str, name: str) -> Callable[..., None] | None:
    """Record this process's collections (``gc.callbacks``) to ``<folder>/gc-<name>-<pid>.jsonl``,
    written in batches (every 64 collections, a second after the last write, and at exit).
    Returns the callback (None where the folder cannot be made)."""
    path = os.path.join(folder, f"gc-{name}-{os.getpid()}.jsonl")
    rows: list[list] = []
    state = {"start": 0.0, "written": time.time()}

    def write() -> None:
        if rows:
            with open(path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            rows.clear()
        state["written"] = time.time()

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            state["start"] = time.time()
            return
        end = time.time()
        rows.append([round(state["start"], 6), round(end, 6), info.get("generation"), info.get("collected")])
        if len(rows) >= 64 or end - state["written"] > 1.0:
            write()

    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        logger.warning(f"{GC_LOG_ENV}={folder}: cannot write there ({e}); collections not logged")
        return None
    gc.callbacks.append(callback)
    atexit.register(write)
    return callback
