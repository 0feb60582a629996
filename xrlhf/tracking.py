"""Metric sinks: ``metrics.jsonl`` always, TensorBoard and wandb when the config asks.

Every metric's name and unit is documented in docs/metrics.md. Rows carry ``step`` (RL step)
or ``warmup_step``. Each row of ``metrics.jsonl`` is one append, flushed and fsynced, so a crash
loses nothing written; a resume drops the rows after its checkpoint by writing the rest aside and
renaming it over the file (never half a file), and only while it holds the run directory's lock
(``xrlhf.rundir.RunLock``): a second process must never cut a live run's metrics short.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from loguru import logger

from xrlhf.config.schema import LoggingConfig
from xrlhf.utils.errors import UserError
from xrlhf.utils.files import atomic_write


class Tracker:
    """Writes each metrics row to every configured sink.

    Args:
        out: the run directory.
        cfg: the ``logging`` section.
        name: the run's name (wandb).
        config: the resolved config (wandb).
        lock: the run directory's ``RunLock`` (``truncate`` needs it held), or ``None``.
    """

    def __init__(self, out: Path, cfg: LoggingConfig, name: str, config: dict[str, Any], lock=None):
        self.path = out / "metrics.jsonl"
        self.lock = lock
        self._f = open(self.path, "a")
        self.tb = self.wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        if cfg.wandb and cfg.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError:
                raise UserError("logging.wandb: wandb is not installed; pip install -e '.[wandb]' "
                                "or set logging.wandb: false") from None
            self.wandb = wandb.init(project=cfg.wandb_project, name=name, config=config, dir=str(out),
                                    mode=cfg.wandb_mode, resume="allow")
            logger.info(f"wandb run in {cfg.wandb_mode} mode under {out}")

    def __call__(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        step = row.get("step", row.get("warmup_step"))
        scalars = {k: float(v) for k, v in row.items()
                   if k not in ("step", "warmup_step") and isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None and step is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars)

    def offset(self) -> int:
        """Bytes of ``metrics.jsonl`` written so far (checkpoints record it for resume)."""
        self._f.flush()
        return self.path.stat().st_size

    def truncate(self, offset: int) -> None:
        """Drop the rows written after ``offset`` bytes (a resumed run writes them again).

        Raises:
            RuntimeError: the run directory's lock is not held by this run.
        """
        if self.lock is None or not self.lock.held:
            raise RuntimeError(f"{self.path} is cut only by the run that holds its directory's lock")
        self._f.flush()
        if self.path.stat().st_size <= offset:
            return
        self._f.close()
        atomic_write(self.path, self.path.read_bytes()[:offset])
        self._f = open(self.path, "a")

    def close(self) -> None:
        self._f.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
