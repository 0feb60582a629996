"""The run directory (``--output-dir``): one writer at a time, and what a new run may do there.

Checked before Ray starts, each problem one line and exit status 2 (``UserError``):

* the path itself (:func:`make_output_dir`): under ``/proc`` or ``/sys``, a file, under a file,
  not creatable, not writable;
* a live run writing there (:class:`RunLock`): an exclusive ``flock`` on ``run.lock``, held for
  the run's life and named in the refusal (pid, host, start time). The kernel drops a flock when
  its process ends however it ends (SIGKILL, the OOM killer), so the lock of a dead run is taken
  over with nothing to clean up, which a pid file cannot do;
* what the directory holds (:func:`check_output_dir`, under the lock): nothing (a new run); a run
  that saved nothing, killed in its start-up or before its first checkpoint (a plain run and
  ``--resume`` both start it again there); a run with checkpoints, RL or warm-up ones
  (``--resume`` only, with the same config, or with more ``trainer.steps`` where the LR schedule
  allows it); a finished run (extended by ``--resume trainer.steps=N``, or the refusal names the
  new run from its ``final/``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from loguru import logger

from xrlhf.checkpoint import any_checkpoint, checkpoint_step, list_checkpoints
from xrlhf.config import XConfig
from xrlhf.engines.training import schedule_uses_total
from xrlhf.resolved import resolve_dict, resolved_config
from xrlhf.utils.errors import UserError

LOCK = "run.lock"
SUMMARY = "summary.json"
VIRTUAL = (Path("/proc"), Path("/sys"))
"""File systems of the kernel's own: a run directory there keeps nothing."""

NEW, AGAIN, RESUME, EXTEND = "new", "again", "resume", "extend"
"""What a run does in its directory (:func:`check_output_dir`)."""


def make_output_dir(out: Path, resume: bool = False) -> None:
    """Create the run directory ``out`` (absolute), or raise ``UserError`` saying in one line why
    it cannot be one and what to do."""
    virtual = next((v for v in VIRTUAL if out == v or v in out.parents), None)
    if virtual is not None:
        raise UserError(f"--output-dir: {out} lies under {virtual}, a virtual file system of the kernel that "
                        f"keeps no files; choose a directory on a disk")
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir: {out} is a file, not a directory; choose another --output-dir")
    blocker = next((p for p in reversed(out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(f"--output-dir: {out} lies under {blocker}, which is a file, not a directory; choose "
                        f"another --output-dir")
    if resume and not out.is_dir():
        raise UserError(f"--resume: {out} does not exist; check --output-dir (a run not started yet needs no "
                        f"--resume)")
    if not out.is_dir():  # whether it can be written: RunLock's file is the first one written there
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--output-dir: cannot create {out} ({e.strerror}); choose a directory you can "
                            f"write to") from None


def _not_writable(out: Path, why: str) -> str:
    return f"--output-dir: {out} is not writable ({why}); choose a directory you can write to"


class RunLock:
    """The one-writer lock of the run directory ``out``: an exclusive ``flock`` on ``out/run.lock``.

    ``run.lock`` holds the holder's pid, host and start time (JSON), for the refusal to name it;
    a clean end empties it, so a record found on taking the lock is a dead run's. The file is
    never removed or replaced: a process that opened the old one would lock a file no one else
    sees. A child forked (not exec'd) by the holder shares the lock until it exits too; Ray's
    workers and the fork server are started by exec and do not.
    """

    def __init__(self, out: Path):
        self.out, self.path = out, out / LOCK
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, or raise ``UserError`` naming the live run that holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(_not_writable(self.out, e.strerror)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(live_run_line(self.out, lock_holder(self.path))) from None
        except OSError as e:
            os.close(fd)
            raise UserError(f"--output-dir: the file system of {self.out} cannot lock {LOCK} ({e.strerror}); "
                            f"choose a directory on a local disk, or a shared file system with locks") from None
        stale = _record(os.pread(fd, 4096, 0))
        if stale:
            logger.info(f"{self.path}: taking over from pid {stale.get('pid')} (started {stale.get('started')}), "
                        f"which ended without a clean exit")
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now().isoformat(sep=" ", timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Give the lock back (emptying the record first: a clean end)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)  # drops the flock
        self._fd = None


def _record(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def lock_holder(path: Path, wait_s: float = 2.0) -> dict[str, Any] | None:
    """The record of the live run holding the lock ``path``: read again for up to ``wait_s``
    while it is empty or names a process of this host that is gone (the holder writes it just
    after taking the lock, over a dead run's); ``None`` if none came."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            record = _record(path.read_bytes())
        except OSError:
            record = None
        if (record and _alive(record)) or time.monotonic() > deadline:
            return record
        time.sleep(0.05)


def _alive(record: dict[str, Any]) -> bool:
    if record.get("host") != socket.gethostname():
        return True  # another machine's process: cannot tell
    try:
        os.kill(int(record.get("pid")), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        pass
    return True


def live_run_line(out: Path, holder: dict[str, Any] | None) -> str:
    """The refusal of a second writer: one line naming the live run."""
    if holder is None:
        who, stop = "a live run (its pid is not recorded yet)", ""
    else:
        pid = holder.get("pid")
        who = f"a live run (pid {pid} on {holder.get('host')}, started {holder.get('started')})"
        stop = f" or stop it (kill -INT {pid})"
    return (f"--output-dir: {out} is being written by {who}; wait for it to end{stop}, or choose another "
            f"--output-dir")


class NewRunNeeded(UserError):
    """A run that cannot go on where it is: the refusal names the command that starts a new run
    from its ``final/`` policy. The CLI rewrites the line with the config and overrides it was given
    (:meth:`line`); the message a caller of ``runner.run`` sees says ``CONFIG``."""

    def __init__(self, why: str, changes: dict[str, str], out: Path):
        self.why, self.changes, self.out = why, changes, out
        super().__init__(self.line("CONFIG", []))

    def command(self, config: str, overrides: list[str]) -> str:
        kept = [o for o in overrides if o.split("=", 1)[0] not in self.changes]
        changes = [f"{k}={v}" for k, v in self.changes.items()]
        return shlex.join(["xrlhf", "run", config, *kept, *changes, "--output-dir", str(self.out)])

    def line(self, config: str, overrides: list[str]) -> str:
        return (f"{self.why}; start a new run from its final policy (optimizer, critic and reference start "
                f"afresh from final/): {self.command(config, overrides)}")


def check_output_dir(out: Path, cfg: XConfig, resume: bool) -> str:
    """What a run of ``cfg`` into ``out`` does there: ``NEW`` (no run there), ``AGAIN`` (a run that
    saved nothing: started over, with or without ``--resume``), ``RESUME`` (from its latest
    checkpoint) or ``EXTEND`` (``--resume`` with more ``trainer.steps``); else ``UserError``.

    A finished run's ``final/``, metrics and TensorBoard events are never replaced or mixed with
    another run's; a run with checkpoints is continued only with ``--resume`` and the same
    config (``trainer.steps`` may grow where the LR schedule does not depend on it; the
    ``checkpoint`` section may change).
    """
    if not (out / "config.yaml").is_file():
        if resume:
            raise UserError(f"--resume: {out} holds no run (no config.yaml); check --output-dir (a run not "
                            f"started yet needs no --resume)")
        return NEW
    finished, ckpts = (out / SUMMARY).is_file(), list_checkpoints(out)
    if any_checkpoint(out) is None and not finished:
        logger.info(f"--resume: {out} has no checkpoint (the run stopped before its first one); starting it from "
                    f"scratch" if resume else f"{out} holds a run that saved nothing (it stopped before its first "
                    f"checkpoint); starting it again there")
        return AGAIN
    if not resume:
        raise UserError(_holds_a_run(out, cfg, finished))
    steps_then = _check_resume_config(out, cfg)
    more = {"trainer.steps": str(cfg.trainer.steps - steps_then)} if cfg.trainer.steps > steps_then else {}
    if finished and not ckpts:
        raise _new_run(out, cfg, f"--resume: {out} is a finished run with no checkpoint left to continue from", more)
    if not ckpts:  # stopped in its warm-up (or the Ray start-up after it): continued from the warm-up's checkpoint
        return EXTEND if more else RESUME
    last = checkpoint_step(ckpts[-1])
    if finished and last >= cfg.trainer.steps:
        why = f"--resume: {out} is a finished run ({cfg.trainer.steps} steps, summary.json); nothing to resume"
        decaying = _decaying(cfg)
        if decaying:
            raise _new_run(out, cfg, f"{why}, and its {decaying} decayed over those steps", {})
        raise UserError(f"{why}; to train it longer: --resume with trainer.steps=N (more than {cfg.trainer.steps})")
    if more:
        logger.info(f"--resume: continuing {out} from {steps_then} to {cfg.trainer.steps} steps (from checkpoint "
                    f"step {last})")
        return EXTEND
    return RESUME


def _holds_a_run(out: Path, cfg: XConfig, finished: bool) -> str:
    """The refusal of a run without ``--resume`` into a directory that holds one."""
    if not finished:
        return f"--output-dir: {out} already holds a run; choose another directory, or add --resume to continue it"
    line = f"--output-dir: {out} already holds a finished run; choose another directory"
    if _decaying(cfg):  # no extension to offer: --resume would name the new run from final/
        return line
    return f"{line}, or train it longer: --resume with trainer.steps=N (more than {_saved_steps(out)})"


def begin_attempt(out: Path, start: str) -> None:
    """Clear what an earlier attempt left that this one would mix with (under the run's lock):
    a run started again drops the TensorBoard events of the steps it redoes from scratch; an
    extended run is unfinished again until it ends (its ``summary.json`` goes)."""
    if start == AGAIN:
        shutil.rmtree(out / "tensorboard", ignore_errors=True)
    elif start == EXTEND:
        (out / SUMMARY).unlink(missing_ok=True)


def _saved_steps(out: Path) -> Any:
    try:
        return (yaml.safe_load((out / "config.yaml").read_text()) or {}).get("trainer", {}).get("steps", "?")
    except (OSError, yaml.YAMLError, AttributeError):
        return "?"


def _decaying(cfg: XConfig) -> str | None:
    """``<section>.lr_schedule (cosine)`` of the first train section whose LR schedule depends
    on the run's length, or ``None``."""
    for path, role, section in cfg.engine_sections():
        if role == "train" and schedule_uses_total(section.lr_schedule):
            return f"{path}.lr_schedule ({section.lr_schedule})"
    return None


FREE_ON_RESUME = ("checkpoint.",)
"""Settings a resume may change: where and how often a run saves does not change its numbers
(and a run started before ``checkpoint.every_minutes`` existed has none in its config.yaml)."""


def _check_resume_config(out: Path, cfg: XConfig) -> int:
    """Refuse a config other than the saved one's, all differences in one go; ``trainer.steps``
    alone may grow (an extension) where no LR schedule depends on it. Returns the saved steps."""
    # both resolved: a default given explicitly now (or left out then) is the same value
    saved = _flatten(resolve_dict(yaml.safe_load((out / "config.yaml").read_text())))
    now = _flatten(resolved_config(cfg))
    diff = sorted(k for k in saved.keys() | now.keys()
                  if saved.get(k) != now.get(k) and not k.startswith(FREE_ON_RESUME))
    then = saved.get("trainer.steps")
    if diff == ["trainer.steps"] and isinstance(then, int) and cfg.trainer.steps > then:
        decaying = _decaying(cfg)
        if decaying:
            raise _new_run(out, cfg, f"--resume: trainer.steps {then} -> {cfg.trainer.steps} cannot continue "
                                     f"{out}: its {decaying} decays over the run's {then} steps",
                           {"trainer.steps": str(cfg.trainer.steps - then)})
        return then
    if diff:
        raise UserError(*[f"--resume: {k} differs from the original run ({saved.get(k)!r} there, {now.get(k)!r} now)"
                          for k in diff])
    return cfg.trainer.steps


def _new_run(out: Path, cfg: XConfig, why: str, changes: dict[str, str]) -> UserError:
    """The refusal of a run that cannot go on: the new run from its ``final/`` where there is one."""
    final = out / "final"
    if not (out / SUMMARY).is_file():
        return UserError(f"{why}; finish it first (--resume with its own trainer.steps), then start a new run "
                         f"with policy.model={final}")
    if not (final / "config.json").is_file():
        what = ("only a LoRA adapter in final/ (policy.train.lora.save: adapter): merge it into its base first"
                if (final / "adapter_config.json").is_file() else "no final/ (trainer.save_final: false)")
        return UserError(f"{why}; a new run would start from its final policy, but the run saved {what}")
    changes = {"policy.model": str(final), **changes, **({"warmup.steps": "0"} if cfg.warmup.steps else {})}
    return NewRunNeeded(why, changes, out.with_name(f"{out.name}-continued"))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}." if not isinstance(v, dict) or v else f"{prefix}{k}"))
    return {k.rstrip("."): v for k, v in out.items()}
