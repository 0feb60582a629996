"""Healing, measured: a run in which a worker of every role is killed (SIGKILL) or frozen
(SIGSTOP) at a random point of a step, once per step, finishes on its own with the final weights
of an uninterrupted run; per fault, how long until the run went on.

The scenario (one PPO run of 17 steps, split layout, 2 policy ranks; `scenario_config`), a
fault in steps 2, 5, 8, 11 and 14, each at a random point of the step:

    rollout rank 0    SIGKILL  -> restarted in place, weights re-synced, the call redone
    reference rank 0  SIGSTOP  -> no heartbeat: killed, restarted in place
    reward rank 0     SIGKILL  -> restarted in place
    critic rank 0     SIGKILL  -> every worker restarts from the last checkpoint
    policy rank 1     SIGSTOP  -> no heartbeat (rank 0 waits in a collective): every worker
                                  restarts from the last checkpoint

``tests/e2e/test_healing.py`` runs it and asserts the final weights; this script runs the
scenario and the uninterrupted run and writes ``healing.json`` with each fault's figures:

    python -m benchmarks.recovery heal --out benchmarks/results      # CPU, ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FAULTS = [("rollout", 0, "SIGKILL"), ("reference", 0, "SIGSTOP"), ("reward", 0, "SIGKILL"),
          ("critic", 0, "SIGKILL"), ("policy", 1, "SIGSTOP")]
"""(handle, rank, signal), in this order, one every ``EVERY`` steps from step 2."""

EVERY = 3


def scenario_config(model: str, heartbeat_s: float = 4.0) -> dict[str, Any]:
    """PPO with every role in a process of its own: policy x2, split-layout rollout, critic,
    reference and a reward model (the tiny model with a score head), checkpoints every step."""
    return {
        "name": "healing", "seed": 0, "ray": {"num_cpus": 2},
        "env": {"name": "reasoning", "options": {"eval_size": 16}},
        "policy": {"model": model, "train": {"lr": 1e-3, "micro_batch_size": 8},
                   "generate": {"max_new_tokens": 4, "resources": {"ranks": 1, "cpus_per_rank": 0.5}},
                   "weight_sync": {"verify": True},
                   "resources": {"ranks": 2, "cpus_per_rank": 0.5}},
        "critic": {"train": {"lr": 1e-3, "micro_batch_size": 8}},
        "reference": {},
        "reward": {"source": "model", "model": model},
        "algorithm": {"name": "ppo", "mini_batch_size": 8, "kl_coef": 0.05},
        "trainer": {"steps": 2 + EVERY * len(FAULTS), "prompts_per_step": 16},
        "checkpoint": {"every": 1, "keep": 2},
        "fault_tolerance": {"max_restarts": len(FAULTS), "heartbeat_timeout_s": heartbeat_s},
        "logging": {"tensorboard": False, "report": False},
    }


@dataclass
class Fault:
    """One injected fault and what was seen of it."""

    handle: str
    rank: int
    signal: str
    step: int
    pid: int = 0
    at: float = 0.0
    """When the signal was sent (time.time())."""
    delay_s: float = 0.0
    """How far into the step (after the previous step's metrics row) it was sent."""
    extra: dict[str, Any] = field(default_factory=dict)


GPU_FAULTS = {1: [("rollout", 0, "SIGKILL", 2), ("policy", 0, "SIGKILL", 4)],
              2: [("rollout", 0, "SIGKILL", 2), ("rollout", 0, "SIGKILL", 4)]}
"""The GPU scenarios' faults by GPU count: (handle, rank, signal, step). On two GPUs (issue 29) the
generator alone, twice: it heals in place (a new NCCL group), so no checkpoint is needed, and the
0.5b's ~18 s checkpoints are left out of that scenario's time."""


def gpu_config(model: str, heartbeat_s: float = 20.0, gpus: int = 1) -> dict[str, Any]:
    """GRPO with vLLM in the split layout, a checkpoint every step. On ONE GPU (``gpus=1``): the
    trainer (bf16, half the GPU in Ray's count) and a vLLM generator of its own (a quarter of the
    GPU's memory, never asleep), weights by the ``cpu`` transport. On two (``gpus=2``, issue 29):
    the trainer on GPU 0, vLLM alone on GPU 1, weights broadcast over NCCL. Verification on.
    Killing the generator restarts vLLM alone (in place, and on two GPUs a new NCCL group);
    killing the trainer (the one-GPU scenario) restarts everything from a checkpoint."""
    share, util, transport = (1, 0.8, "nccl") if gpus == 2 else (0.5, 0.25, "cpu")
    faults = GPU_FAULTS[gpus]
    return {
        "name": "healing-gpu", "seed": 0, "ray": {"num_gpus": gpus},
        "env": {"name": "reasoning", "options": {"tasks": ["add", "compare"], "max_operand": 20, "eval_size": 16}},
        "policy": {"model": model,
                   "train": {"dtype": "bfloat16", "lr": 1e-6, "micro_batch_size": 32},
                   "generate": {"engine": "vllm", "dtype": "bfloat16", "max_new_tokens": 64,
                                "gpu_memory_utilization": util, "sleep_level": 0, "max_model_len": 512,
                                "max_num_seqs": 256, "multiprocessing": gpus == 2,  # two GPUs: as measured
                                "resources": {"ranks": 1, "cpus_per_rank": 2, "gpus_per_rank": share}},
                   "weight_sync": {"transport": transport, "verify": True},
                   "resources": {"ranks": 1, "cpus_per_rank": 2, "gpus_per_rank": share}},
        "algorithm": {"name": "grpo", "mini_batch_size": 128, "kl_coef": 0.0},
        "trainer": {"steps": 6 if gpus == 1 else 5, "prompts_per_step": 32, "samples_per_prompt": 4,
                    "eval_every": 0},
        "checkpoint": {"every": 1 if gpus == 1 else 0, "every_minutes": 0, "keep": 2},
        "fault_tolerance": {"max_restarts": len(faults), "heartbeat_timeout_s": heartbeat_s},
        "logging": {"tensorboard": False, "report": False},
    }


def _rows(run_dir: Path) -> list[dict]:
    """The run's metrics rows so far (none before its first)."""
    from xrlhf.report import read_metrics

    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []


def _done_steps(out: Path) -> set[int]:
    return {r["step"] for r in _rows(out) if "reward/mean" in r}


def inject(out: Path, proc: subprocess.Popen, faults: list[Fault], seed: int = 0, timeout: float = 600,
           within_s: float = 0.25) -> None:
    """For each fault: wait until step ``fault.step - 1`` is logged (the fault's step is under way),
    wait a random time up to ``within_s`` (about a step here), and signal the handle's rank
    (``workers.json`` names it); then wait until it was replaced."""
    rng = random.Random(seed)
    deadline = time.time() + timeout
    for f in faults:
        while f.step - 1 not in _done_steps(out) | {0} or not (out / "workers.json").is_file():
            if proc.poll() is not None or time.time() > deadline:
                return
            time.sleep(0.05)
        f.delay_s = rng.uniform(0.0, within_s)
        time.sleep(f.delay_s)
        f.pid = json.loads((out / "workers.json").read_text())[f.handle][f.rank]
        f.at = time.time()
        # the step under way when the signal is sent: later than f.step when steps are short
        f.extra["landed_in_step"] = max(_done_steps(out) | {0}) + 1
        try:
            os.kill(f.pid, getattr(signal, f.signal))
        except ProcessLookupError:
            f.extra["missed"] = True
        # the next fault waits for this one to be healed: its handle's pids change
        while json.loads((out / "workers.json").read_text()).get(f.handle, [None] * (f.rank + 1))[f.rank] == f.pid:
            if proc.poll() is not None or time.time() > deadline:
                return
            time.sleep(0.05)


def run_with_faults(config: dict, work: Path, faults: list[Fault] | None = None, seed: int = 0,
                    timeout: float = 900, within_s: float = 0.25) -> tuple[int, str, float]:
    """``xrlhf run`` of ``config`` in ``work/run`` in a process of its own, faults injected from a
    thread; returns (exit status, output, wall seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / "run"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "xrlhf.cli", "run", str(path), "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    killer = threading.Thread(target=inject, args=(out, proc, faults or [], seed, timeout, within_s), daemon=True)
    killer.start()
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
    killer.join(timeout=5)
    return proc.returncode, text, time.time() - t0


def scenario_faults() -> list[Fault]:
    return [Fault(h, r, s, step=2 + EVERY * i) for i, (h, r, s) in enumerate(FAULTS)]


def figures(faults: list[Fault], summary: dict) -> list[dict]:
    """Each fault with its healing event: detected after (s), healed how, recovered in (s),
    work redone, step back in (s): from the signal to the fault's step being logged."""
    events = summary.get("healed", [])
    rows = []
    for f, e in zip(faults, events):
        rows.append({"handle": f.handle, "rank": f.rank, "signal": f.signal,
                     "step": f.extra.get("landed_in_step", f.step),
                     "delay_into_step_s": round(f.delay_s, 3), "healed": e["how"], "redone": e["redone"],
                     "recover_s": e["recover_s"], "error": e["error"]})
    return rows


def gpu_main(args: argparse.Namespace) -> None:
    """The GPU scenario (``gpu_config``): the generator's and the trainer's time to recover with
    vLLM, and whether the killed generator's engine process left its GPU memory behind."""
    work = Path(args.work)
    faults = [Fault(h, r, sig, step=st) for h, r, sig, st in GPU_FAULTS[args.gpus]]
    cfg = gpu_config(args.model, gpus=args.gpus)
    name = "gpu" if args.gpus == 1 else f"gpu{args.gpus}"
    code, text, wall = run_with_faults(cfg, work / name, faults, timeout=args.timeout, within_s=1.5)
    (work / f"{name}.log").write_text(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"healing_{name}.log").write_text(text)  # whole: which fault healed how is at its start
    summary_path = work / name / "run" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()
    result = {"hardware": _gpu(), "command": f"python -m benchmarks.recovery heal --gpu --gpus {args.gpus}", "exit": code,
              "layout": "split, vLLM on GPU 1, nccl" if args.gpus == 2 else "split on one GPU, cpu transport",
              "steps": cfg["trainer"]["steps"], "wall_s_with_faults": round(wall, 1),
              "heartbeat_timeout_s": cfg["fault_tolerance"]["heartbeat_timeout_s"],
              "faults": figures(faults, summary), "gpu_processes_after_run": apps,
              "log_tail": text[-3000:] if code != 0 else ""}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"healing_{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _gpu() -> str:
    import torch

    return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if torch.cuda.is_available() else "none"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.recovery heal", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--work", default="/tmp/xrlhf-healing")
    ap.add_argument("--gpu", action="store_true", help="the one-GPU scenario with vLLM (healing_gpu.json)")
    ap.add_argument("--model", default="artifacts/model-0.5b", help="--gpu: the model directory")
    ap.add_argument("--gpus", type=int, default=1, choices=[1, 2],
                    help="--gpu: 1 (both handles share one GPU) or 2 (vLLM on a GPU of its own, NCCL)")
    ap.add_argument("--timeout", type=float, default=540, help="--gpu: seconds before the run is killed")
    args = ap.parse_args(argv)
    if args.gpu:
        return gpu_main(args)
    from safetensors.torch import load_file

    from xrlhf.models.tiny import build_model

    work = Path(args.work)
    model = str(build_model(work / "tiny"))
    cfg = scenario_config(model)
    code0, text0, wall0 = run_with_faults(cfg, work / "straight")
    faults = scenario_faults()
    code, text, wall = run_with_faults(cfg, work / "faults", faults)
    if code0 != 0 or code != 0:
        sys.exit(f"a run failed ({code0}, {code}):\n{text0[-3000:]}\n{text[-3000:]}")
    summary = json.loads((work / "faults" / "run" / "summary.json").read_text())
    a, b = (load_file(str(work / d / "run" / "final" / "model.safetensors")) for d in ("straight", "faults"))
    result = {"hardware": f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
              "command": "python -m benchmarks.recovery heal", "steps": cfg["trainer"]["steps"],
              "wall_s_uninterrupted": round(wall0, 1), "wall_s_with_faults": round(wall, 1),
              "final_weights_identical": a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a),
              "heartbeat_timeout_s": cfg["fault_tolerance"]["heartbeat_timeout_s"],
              "faults": figures(faults, summary)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "healing.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))

