"""Checkpoints for exact resume: everything a run needs to continue bit for bit.

A checkpoint is a directory ``checkpoints/step-00000010`` holding:

* ``driver.pt``: the trainer's state (step, data position, KL controller, shuffle RNG, eval
  results so far), the driver's RNG states, the metrics.jsonl length, the RL start model;
* ``<handle>.pt`` for every trainable handle (policy, critic): model, optimizer and LR
  scheduler state from rank 0 (all data-parallel ranks hold the same);
* ``rng.pt``: the RNG state of every rank of every handle.

It is written to a temporary directory and renamed into place, so a run killed at any moment
leaves either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from loguru import logger

PREFIX = "step-"


def checkpoint_dir(out: Path) -> Path:
    return out / "checkpoints"


def save_checkpoint(out: Path, step: int, driver: dict[str, Any], handles: dict[str, Any], keep: int) -> Path:
    """Write the checkpoint of ``step`` atomically and keep the last ``keep``.

    Args:
        out: the run directory.
        driver: the trainer's and runner's own state.
        handles: name -> ``ModelHandle`` of every handle of the run.
    """
    root = checkpoint_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {**driver, "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}
    torch.save(state, tmp / "driver.pt")
    for name, handle in handles.items():
        if _trainable(handle):
            torch.save(handle.state_dict(), tmp / f"{name}.pt")
    torch.save({name: h.rng_state() for name, h in handles.items()}, tmp / "rng.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info(f"checkpoint step {step} -> {final}")
    return final


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "rng.pt").is_file())


def load_driver_state(path: Path) -> dict[str, Any]:
    state = torch.load(path / "driver.pt", weights_only=False)
    random.setstate(state.pop("python_rng"))
    torch.set_rng_state(state.pop("torch_rng"))
    return state


def restore_handles(path: Path, handles: dict[str, Any]) -> None:
    """Load model/optimizer/scheduler and RNG states into every rank of every handle."""
    rng = torch.load(path / "rng.pt", weights_only=False)
    for name, handle in handles.items():
        if _trainable(handle):
            handle.load_state_dict(torch.load(path / f"{name}.pt", weights_only=False))
        if name in rng:
            handle.set_rng_state(rng[name])


def _trainable(handle) -> bool:
    return getattr(handle, "trainable", False)
