"""Supervised warm-up: a short SFT of the policy on the env's examples before RL.

A tiny model built from random weights cannot discover an answer format by sampling alone;
a few hundred supervised steps give RL a policy that is sometimes right, which is what the
papers' SFT stage does too. Runs in the driver process on the Transformers train engine (no
Ray), and writes the result in HF format: the RL policy, reference and critic start from it.
"""

from __future__ import annotations

import time
from pathlib import Path

from loguru import logger

from xrlhf.algorithms.base import evaluate, sampling_params
from xrlhf.algorithms.losses import SFTLoss
from xrlhf.config.schema import XConfig
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, encode_target
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFGenerateEngine, HFTrainEngine
from xrlhf.envs import Env


def supervised_warmup(cfg: XConfig, env: Env, tokenizer, model_dir: str, out_dir: Path,
                      log=lambda m: None) -> tuple[str, dict[str, float]]:
    """Train ``model_dir`` on ``cfg.warmup.steps`` batches of ``env.sft_examples``.

    Returns:
        the directory of the warmed-up model and eval metrics before it (``eval/...``; empty
        for an env scored by a reward model, which is not running yet).
    """
    w = cfg.warmup
    spec = EngineSpec(model_path=model_dir, options={"lr": w.lr, "micro_batch_size": w.batch_size,
                                                     "grad_clip": 1.0, "lr_warmup_steps": min(20, w.steps // 10),
                                                     "lr_schedule": "cosine", "total_steps": w.steps},
                      seed=cfg.seed)
    before: dict[str, float] = {}
    if env.reward_source != "model":  # a reward-model env is scored once the reward handle runs
        gen = HFGenerateEngine(spec)
        params = sampling_params(cfg, cfg.trainer.eval_temperature)
        before = evaluate(gen.generate, env, tokenizer, params, cfg.trainer.eval_size)
        logger.info(f"warm-up: eval reward before {before['eval/reward_mean']:.3f}")
    logger.info(f"warm-up: {w.steps} SFT steps")
    engine = HFTrainEngine(spec)
    t0 = time.time()
    for step in range(w.steps):
        examples = env.sft_examples(step * w.batch_size, w.batch_size)
        batch = build_sequences([encode_prompt(tokenizer, p) for p, _ in examples],
                                [encode_target(tokenizer, c) for _, c in examples], tokenizer.pad_token_id)
        m = engine.train_step(batch, SFTLoss())
        if (step + 1) % max(1, w.steps // 10) == 0 or step + 1 == w.steps:
            logger.info(f"warm-up step {step + 1}/{w.steps} | nll {m['loss']:.3f} | "
                        f"token acc {m['sft/token_accuracy']:.2f} | {time.time() - t0:.0f}s")
            log({"warmup_step": step + 1, "warmup/nll": m["loss"], "warmup/token_accuracy": m["sft/token_accuracy"]})
    path = out_dir / "warmup"
    engine.save_pretrained(str(path))
    return str(path), before
