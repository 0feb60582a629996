"""Checkpoints for exact resume: everything a run needs to continue bit for bit.

A checkpoint is a directory ``checkpoints/step-00000010`` holding:

* ``driver.pt``: the trainer's state (step, data position, KL controller, shuffle RNG, eval
  results so far), the driver's RNG states, the metrics.jsonl length, the RL start model;
* ``<handle>/`` for every trainable handle (policy, critic): model, optimizer and LR scheduler
  state, written by the handle's ranks themselves (``TrainEngine.save_state``): ``state.pt`` from
  rank 0 of a replicated engine, every rank's shard files of a DeepSpeed engine. Nothing passes
  through the driver, so its memory stays flat whatever the model's size; the run directory must
  be on storage every rank's machine can write (a shared filesystem across machines);
* ``rng.pt``: the RNG state of every rank of every handle;
* ``manifest.json``, written last: every other file's size and sha256.

It is written to a temporary directory and renamed into place, so a run killed at any moment
leaves either the previous checkpoint or the new one, never half of one. The manifest catches
what renaming cannot: a file cut short or changed afterwards (a full disk, a copy that stopped,
a shard written by a rank that died). A resume uses the newest checkpoint whose files match
their manifest; one that does not is moved aside (``torn-step-...``) with a warning naming the
file, and the one before it is used. Retention (``checkpoint.keep``) counts verified checkpoints
only, and deletes old ones only after the new one is complete, so it never deletes the only good one.

When a run writes one (:class:`SaveSchedule`): every ``checkpoint.every`` steps, and at the first
step's end ``checkpoint.every_minutes`` after the last one (10 by default, so that a SIGKILL never
costs more than about that much; off where a config sets ``every`` alone); the last step and a
signal always write one. A save reads the
RNG states, never draws from them: where and how often a run saves does not change its numbers.

The supervised warm-up before RL saves the same way, by the same schedule counted in warm-up
steps, as ``checkpoints/warmup-00000050`` (its policy handle and the warm-up's own state:
``algorithms.warmup``); the first RL checkpoint supersedes them and they are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from loguru import logger

from xrlhf.utils.errors import UserError
from xrlhf.utils.files import atomic_write, fsync_dir

PREFIX = "step-"
"""An RL checkpoint's directory name: ``step-00000010``."""
WARMUP = "warmup-"
"""A warm-up checkpoint's: ``warmup-00000050`` (after 50 warm-up steps)."""
MANIFEST = "manifest.json"
TORN = "torn-"


def checkpoint_dir(out: Path) -> Path:
    return out / "checkpoints"


def checkpoint_step(path: Path) -> int:
    """The step of the checkpoint directory ``path`` (``step-00000010``, ``warmup-00000010``: 10)."""
    return int(path.name.rsplit("-", 1)[1])


class SaveSchedule:
    """Whether a step's end writes a checkpoint: every ``every`` steps (0: never by steps), or
    once ``every_minutes`` have passed since the last save or the start (0: never by time),
    whichever comes first. ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, every: int, every_minutes: float, clock: Callable[[], float] = time.monotonic):
        self.every, self.seconds, self.clock = every, every_minutes * 60, clock
        self.last = clock()
        self.step: int | None = None
        """The step last saved (or resumed from): saved already, not to be written again."""

    @property
    def on(self) -> bool:
        """Whether checkpoints are wanted at all (by steps or by time): with neither, only a stop saves."""
        return bool(self.every or self.seconds)

    def due(self, step: int) -> bool:
        by_steps = bool(self.every) and step % self.every == 0
        return by_steps or (bool(self.seconds) and self.clock() - self.last >= self.seconds)

    def saved(self, step: int | None = None) -> None:
        """A checkpoint (of ``step``) was written or resumed from (by this schedule, the last step or
        a signal): time counts from now."""
        self.last = self.clock()
        self.step = step if step is not None else self.step


def save_checkpoint(out: Path, step: int, driver: dict[str, Any], handles: dict[str, Any], keep: int,
                    prefix: str = PREFIX) -> Path:
    """Write the checkpoint of ``step`` atomically and keep the last ``keep``.

    Args:
        out: the run directory.
        driver: the trainer's and runner's own state.
        handles: name -> ``ModelHandle`` of every handle of the run.
        prefix: :data:`PREFIX` (an RL step) or :data:`WARMUP` (a warm-up step).
    """
    root = checkpoint_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{prefix}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {**driver, "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}
    _save(state, tmp / "driver.pt")
    for name, handle in handles.items():
        if _trainable(handle):  # each rank writes its own part: no state through the driver
            handle.save_state(str(tmp / name))
            if not (tmp / name).is_dir() or not any((tmp / name).iterdir()):
                shutil.rmtree(tmp, ignore_errors=True)
                raise UserError(f"checkpoint: {name}'s workers wrote their state to {tmp / name}, which this "
                                f"machine does not see; on a cluster the run directory (--output-dir) must be on "
                                f"storage every node mounts at the same path (docs/cluster.md)")
    _save({name: h.rng_state() for name, h in handles.items()}, tmp / "rng.pt")
    write_manifest(tmp, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    for old in list_checkpoints(out, prefix)[:-keep]:  # complete ones only: the new one is among them
        shutil.rmtree(old, ignore_errors=True)
    logger.info(f"checkpoint {'warm-up ' if prefix == WARMUP else ''}step {step} -> {final}")
    return final


def remove_checkpoints(out: Path, prefix: str) -> None:
    """Remove the complete checkpoints of kind ``prefix`` (the warm-up's, once RL saved one)."""
    for path in list_checkpoints(out, prefix):
        shutil.rmtree(path, ignore_errors=True)


def _save(obj: Any, path: Path) -> None:
    """``torch.save``, on disk before the checkpoint is renamed into place (fsync)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(path: Path, step: int) -> None:
    """``manifest.json`` of the checkpoint directory ``path``: each file's size and sha256
    (written last: its presence says every file was written)."""
    files = {str(f.relative_to(path)): {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in _files(path)}
    atomic_write(path / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with the checkpoint ``path`` (``None``: its files match its manifest)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        if (path / "rng.pt").is_file():  # written before manifests existed (renamed into place whole)
            return None
        return f"no {MANIFEST}: its writing never finished"
    except (ValueError, KeyError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for name, want in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {want['bytes']}"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def list_checkpoints(out: Path, prefix: str = PREFIX) -> list[Path]:
    """Complete checkpoints of a run (a manifest was written), oldest first: RL ones, or with
    ``prefix`` :data:`WARMUP` the warm-up's; temporary and torn directories are ignored. Files
    are not re-read: :func:`resume_checkpoint` verifies them."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix) and _complete(p))


def any_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of a run, RL or warm-up (``None``: it saved nothing)."""
    ckpts = list_checkpoints(out) or list_checkpoints(out, WARMUP)
    return ckpts[-1] if ckpts else None


def _complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / "rng.pt").is_file()  # rng.pt alone: before manifests


def resume_checkpoint(out: Path, prefix: str = PREFIX) -> Path | None:
    """The newest checkpoint (of kind ``prefix``) whose files match its manifest (``None``:
    none). A newer one that does not is renamed ``torn-step-...`` (kept for a person to look at,
    never resumed from) with a warning saying what is wrong and which checkpoint is used instead."""
    ckpts = list_checkpoints(out, prefix)
    root = checkpoint_dir(out)
    torn = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix)
                  and not _complete(p)) if root.is_dir() else []
    for path in sorted([*ckpts, *torn], reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        older = [c for c in ckpts if c.name < path.name]
        aside = path.with_name(TORN + path.name)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        logger.warning(f"checkpoint {path.name} is torn ({problem}); moved to {aside.name} and "
                       + (f"trying the one before it, {older[-1].name}" if older else "no older checkpoint is left"))
    return None


def read_driver_state(path: Path) -> dict[str, Any]:
    """The driver's state saved in checkpoint ``path``, this process's RNGs left as they are."""
    return torch.load(path / "driver.pt", weights_only=False)


def load_driver_state(path: Path) -> dict[str, Any]:
    """The driver's state saved in checkpoint ``path``; this process's RNGs are set to its own."""
    state = read_driver_state(path)
    random.setstate(state.pop("python_rng"))
    torch.set_rng_state(state.pop("torch_rng"))
    return state


def restore_handles(path: Path, handles: dict[str, Any]) -> None:
    """Load model/optimizer/scheduler and RNG states into every rank of every handle."""
    rng = torch.load(path / "rng.pt", weights_only=False)
    for name, handle in handles.items():
        if _trainable(handle) and (path / name).is_dir():
            handle.load_state(str(path / name))
        elif _trainable(handle):  # a checkpoint written before ranks wrote their own parts
            handle.load_state_dict(torch.load(path / f"{name}.pt", weights_only=False))
        if name in rng:
            handle.set_rng_state(rng[name])


def _trainable(handle) -> bool:
    return getattr(handle, "trainable", False)
