"""Supervised warm-up: a short SFT of the policy on the env's examples before RL.

A tiny model built from random weights cannot discover an answer format by sampling alone;
a few hundred supervised steps give RL a policy that is sometimes right, which is what the
papers' SFT stage does too. Runs in the driver process without Ray, through ``LocalHandle``
(the code a Ray worker runs), on the policy's own engines: its train engine (``policy.train``:
backend, device, dtype; with the warm-up's learning rate, batch size and a cosine schedule)
and, for the evaluation before it, its generate engine (``policy.generate``). No second
execution path: a DeepSpeed or vLLM policy warms up on DeepSpeed or vLLM. It writes the result
in HF format: the RL policy, reference and critic start from it.
"""

from __future__ import annotations

import time
from pathlib import Path

from loguru import logger

from xrlhf.algorithms.rollout import sampling_params
from xrlhf.algorithms.rollout.episodes import EpisodeRunner
from xrlhf.algorithms.rollout.evaluate import evaluate, evaluate_episodes
from xrlhf.algorithms.local import LocalHandle
from xrlhf.algorithms.losses import SFTLoss
from xrlhf.config.schema import XConfig
from xrlhf.data.batch import Batch, build_sequences
from xrlhf.data.chat import ChatFormat
from xrlhf.data.text import encode_prompt, encode_target
from xrlhf.engines.base import EngineSpec, engine_options
from xrlhf.envs import Env
from xrlhf.envs.episode import is_episode_env


def warmup_specs(cfg: XConfig, model_dir: str) -> tuple[EngineSpec, EngineSpec]:
    """The specs of the policy's train and generate engines for the warm-up: the policy's own
    backends, device and dtype; the warm-up's ``lr``, ``batch_size`` (as the micro-batch: one
    micro-batch per step), clipping at 1 and a cosine schedule with 10% linear warm-up. With
    ``policy.train.lora`` the warm-up trains every weight, or with ``warmup.lora`` the adapters
    (merged into what it writes); either way it writes a whole model, the base of the RL's adapters."""
    p, w = cfg.policy, cfg.warmup
    device = "cuda" if p.resources.gpus_per_rank > 0 else "cpu"
    train = {**p.train.engine_fields(), "lr": w.lr, "micro_batch_size": w.batch_size, "grad_clip": 1.0,
             "lr_warmup_steps": min(20, w.steps // 10), "lr_schedule": "cosine"}
    if train.get("lora") is not None:  # LoRA RL: the warm-up writes a whole model for the RL's adapters to start on
        train["lora"] = {**train["lora"], "save": "merged"} if w.lora else None
        logger.info("warm-up: " + ("LoRA adapters, merged into the model it writes" if w.lora else
                                   "every weight (warmup.lora: false); the RL's LoRA adapters start on its result"))
    train_spec = EngineSpec(model_path=model_dir, device=device, seed=cfg.seed, total_steps=w.steps,
                            options=engine_options(p.train.engine, "train", train, "policy.train"))
    gen_spec = EngineSpec(model_path=model_dir, device=device, seed=cfg.seed,
                          options=engine_options(p.generate.engine, "generate", p.generate.engine_fields(),
                                                 "policy.generate"))
    return train_spec, gen_spec


def supervised_warmup(cfg: XConfig, env: Env, tokenizer, model_dir: str, out_dir: Path,
                      log=lambda m: None, stop=lambda: False) -> tuple[str, dict[str, float]]:
    """Train ``model_dir`` on ``cfg.warmup.steps`` batches of ``env.sft_examples``.

    ``stop()`` is asked between steps (a signal was received): when true, the warm-up ends
    there without saving, and the caller stops the run.

    Returns:
        the directory of the warmed-up model and eval metrics before it (``eval/...``; empty
        for an env scored by a reward model, which is not running yet).
    """
    w = cfg.warmup
    train_spec, gen_spec = warmup_specs(cfg, model_dir)
    before: dict[str, float] = {}
    if env.reward_source != "model":  # a reward-model env is scored once the reward handle runs
        gen = LocalHandle.build("policy", {"generate": (cfg.policy.generate.engine, gen_spec)})
        params = sampling_params(cfg, cfg.trainer.eval_temperature)
        try:
            if is_episode_env(env):
                before = evaluate_episodes(EpisodeRunner(env, tokenizer, gen), params, cfg.trainer.eval_size, cfg.seed)
            else:
                before = evaluate(gen, env, tokenizer, params, cfg.trainer.eval_size, seed=cfg.seed)
        finally:
            gen.shutdown()  # before training starts: a vLLM generator gives its GPU memory back
        logger.info(f"warm-up: eval reward before {before['eval/reward_mean']:.3f}")
    logger.info(f"warm-up: {w.steps} SFT steps")
    policy = LocalHandle.build("policy", {"train": (cfg.policy.train.engine, train_spec)})
    t0 = time.time()
    for step in range(w.steps):
        if stop():
            logger.warning(f"warm-up stopped at step {step}/{w.steps}")
            return model_dir, before
        m = policy.train_step(sft_batch(env, tokenizer, step * w.batch_size, w.batch_size), SFTLoss())
        if (step + 1) % max(1, w.steps // 10) == 0 or step + 1 == w.steps:
            logger.info(f"warm-up step {step + 1}/{w.steps} | nll {m['loss']:.3f} | "
                        f"token acc {m['sft/token_accuracy']:.2f} | {time.time() - t0:.0f}s")
            log({"warmup_step": step + 1, "warmup/nll": m["loss"], "warmup/token_accuracy": m["sft/token_accuracy"]})
    path = out_dir / "warmup"
    policy.save_pretrained(str(path))
    return str(path), before


def sft_batch(env: Env, tokenizer, start: int, n: int) -> Batch:
    """Examples ``start .. start + n - 1`` of the env as a batch: a one-turn env's ``(prompt,
    answer)`` pairs (answer + EOS trained), an episode env's whole conversations (the chat
    template's assistant turns trained, everything else masked: ``ChatFormat.encode_conversation``)."""
    if not is_episode_env(env):
        examples = env.sft_examples(start, n)
        return build_sequences([encode_prompt(tokenizer, p) for p, _ in examples],
                               [encode_target(tokenizer, c) for _, c in examples], tokenizer.pad_token_id)
    chat = ChatFormat(tokenizer)
    prompts, responses, masks = [], [], []
    for messages in env.sft_conversations(start, n):
        ids, mask = chat.encode_conversation(messages)
        first = mask.index(1)
        prompts.append(ids[:first])
        responses.append(ids[first:])
        masks.append(mask[first:])
    return build_sequences(prompts, responses, tokenizer.pad_token_id, response_masks=masks)
