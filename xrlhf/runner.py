"""One run, start to finish: output directory, warm-up, Ray handles, the trainer, summary.

Outputs in the run directory: ``config.yaml`` (resolved), ``train.log``, ``metrics.jsonl``
(one JSON object per step), ``summary.json``, ``final/`` (the policy in HF format).
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from loguru import logger

from xrlhf.config import XConfig, algorithm_options, dump_config
from xrlhf.data.text import load_tokenizer
from xrlhf.envs import build_env


class MetricsWriter:
    """Appends one JSON object per call to ``metrics.jsonl`` (flushed: a crash loses nothing)."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a")

    def __call__(self, metrics: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def default_output_dir(cfg: XConfig) -> Path:
    return Path("runs") / f"{cfg.name or 'run'}-{datetime.now():%Y%m%d-%H%M%S}"


def run(cfg: XConfig, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; returns (and writes) ``summary.json``."""
    from xrlhf.algorithms import ALGORITHMS
    from xrlhf.algorithms.rewards import build_reward
    from xrlhf.algorithms.warmup import supervised_warmup
    from xrlhf.coordinator import Coordinator

    t_start = time.time()
    out = Path(output_dir) if output_dir else default_output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    sink = logger.add(out / "train.log", level="DEBUG")
    writer = MetricsWriter(out / "metrics.jsonl")
    logger.info(f"run {cfg.name!r} -> {out}")
    try:
        env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
        tokenizer = load_tokenizer(cfg.policy.model)
        model_dir, extra = cfg.policy.model, {}
        if cfg.warmup.steps:
            model_dir, before = supervised_warmup(cfg, env, tokenizer, model_dir, out, writer)
            if "eval/reward_mean" in before:
                extra["eval_reward_before_warmup"] = before["eval/reward_mean"]
        trainer_cls = ALGORITHMS.get(cfg.algorithm.name)
        options = algorithm_options(cfg)
        coord = Coordinator(cfg, model_dir, trainer_cls.train_steps(cfg, options),
                            policy_head=trainer_cls.policy_head, generate=trainer_cls.uses_generation)
        try:
            coord.start()
            trainer = trainer_cls(cfg, options, coord, env, tokenizer, build_reward(cfg, env, coord), writer)
            result = trainer.fit()
            final = ""
            if cfg.trainer.save_final:
                final = str((out / "final").resolve())
                coord["policy"].save_pretrained(final)
        finally:
            coord.shutdown()
        summary = {"steps": result["steps"], "wall_seconds": round(time.time() - t_start, 1),
                   "eval_reward_initial": result["eval_reward_initial"],
                   "eval_reward_final": result["eval_reward_final"], "final_checkpoint": final, **extra,
                   **result.get("summary", {}),
                   "eval_initial": result["eval_initial"], "eval_final": result["eval_final"]}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.info(f"done in {summary['wall_seconds']:.0f}s: eval reward {summary['eval_reward_initial']:.3f} -> "
                    f"{summary['eval_reward_final']:.3f}; summary in {out / 'summary.json'}")
        return summary
    finally:
        writer.close()
        logger.remove(sink)
