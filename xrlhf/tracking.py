"""Metric sinks: ``metrics.jsonl`` always, TensorBoard and wandb when the config asks.

Every metric's name and unit is documented in docs/metrics.md. Rows carry ``step`` (RL step)
or ``warmup_step``; ``metrics.jsonl`` is flushed on every row so a crash loses nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from loguru import logger

from xrlhf.config.schema import LoggingConfig
from xrlhf.utils.errors import UserError


class Tracker:
    """Writes each metrics row to every configured sink.

    Args:
        out: the run directory.
        cfg: the ``logging`` section.
        name: the run's name (wandb).
        config: the resolved config (wandb).
    """

    def __init__(self, out: Path, cfg: LoggingConfig, name: str, config: dict[str, Any]):
        self.path = out / "metrics.jsonl"
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

    def close(self) -> None:
        self._f.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def truncate_metrics(path: Path, offset: int) -> None:
    """Drop rows written after a checkpoint (the resumed run writes them again)."""
    if path.is_file() and path.stat().st_size > offset:
        with open(path, "r+") as f:
            f.truncate(offset)
