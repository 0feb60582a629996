"""Supervised warm-up: a short SFT of the policy on the env's examples before RL.

A tiny model built from random weights cannot discover an answer format by sampling alone;
a few hundred supervised steps give RL a policy that is sometimes right, which is what the
papers' SFT stage does too. Runs in the driver process without Ray, through ``LocalHandle``
(the code a Ray worker runs), on the policy's own engines: its train engine (``policy.train``:
backend, device, dtype; with the warm-up's learning rate, batch size and a cosine schedule)
and, for the evaluation before it, its generate engine (``policy.generate``). No second
execution path: a DeepSpeed or vLLM policy warms up on DeepSpeed or vLLM. It writes the result
in HF format: the RL policy, reference and critic start from it.

It saves like the RL steps do (:class:`WarmupSaves`, ``xrlhf.checkpoint``): its policy handle's
state (model, optimizer, schedule, RNG) every ``checkpoint.every`` warm-up steps or
``every_minutes``, at a stop, and at its end; ``--resume`` continues from the last one, and a
resumed warm-up ends with the weights of an uninterrupted one.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from loguru import logger

from xrlhf.algorithms.rollout import sampling_params
from xrlhf.algorithms.rollout.episodes import EpisodeRunner
from xrlhf.algorithms.rollout.evaluate import evaluate, evaluate_episodes
from xrlhf.algorithms.local import LocalHandle
from xrlhf.algorithms.losses import SFTLoss
from xrlhf.checkpoint import WARMUP, SaveSchedule, load_driver_state, read_driver_state, restore_handles, save_checkpoint
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


@dataclass
class WarmupSaves:
    """Where and when the warm-up saves (``checkpoints/warmup-*``).

    Attributes:
        out: the run directory.
        schedule: whether a warm-up step's end saves (``checkpoint.every`` / ``every_minutes``).
        keep: how many are kept (``checkpoint.keep``).
        runner_state: the runner's own state, saved beside the warm-up's (metrics offset, time).
        resume: the checkpoint to continue from (``None``: the warm-up starts).
        guard: entered around each write (the runner's: a second Ctrl-C lets the write finish).
    """

    out: Path
    schedule: SaveSchedule
    keep: int
    runner_state: Callable[[], dict[str, Any]]
    resume: Path | None = None
    guard: Callable[[], AbstractContextManager] = nullcontext

    def resumed(self) -> dict[str, Any] | None:
        """The warm-up's own state in ``resume`` (``step``, ``before``), without restoring anything."""
        return read_driver_state(self.resume)["warmup"] if self.resume is not None else None

    def restore(self, policy: LocalHandle) -> int:
        """Load ``resume`` into ``policy`` and this process's RNGs; returns its warm-up step."""
        state = load_driver_state(self.resume)
        restore_handles(self.resume, {"policy": policy})
        self.schedule.saved(state["warmup"]["step"])
        return state["warmup"]["step"]

    def save(self, step: int, policy: LocalHandle, before: dict[str, float]) -> None:
        """Checkpoint warm-up step ``step`` (nothing when it is saved already)."""
        if step == self.schedule.step:
            return
        with self.guard():
            save_checkpoint(self.out, step, {**self.runner_state(), "warmup": {"step": step, "before": before}},
                            {"policy": policy}, self.keep, prefix=WARMUP)
        self.schedule.saved(step)


def supervised_warmup(cfg: XConfig, env: Env, tokenizer, model_dir: str, out_dir: Path,
                      log=lambda m: None, stop=lambda: False,
                      saves: WarmupSaves | None = None) -> tuple[str, dict[str, float]]:
    """Train ``model_dir`` on ``cfg.warmup.steps`` batches of ``env.sft_examples``.

    ``stop()`` is asked between steps (a signal was received): when true, the warm-up saves
    its step (``saves``) and ends there, and the caller stops the run. ``saves``: checkpoints
    by its schedule and at the end, and the checkpoint to continue from (``None``: none at all).

    Returns:
        the directory of the warmed-up model and eval metrics before it (``eval/...``; empty
        for an env scored by a reward model, which is not running yet).
    """
    w = cfg.warmup
    train_spec, gen_spec = warmup_specs(cfg, model_dir)
    resumed = saves.resumed() if saves is not None else None
    before = resumed["before"] if resumed is not None else _eval_before(cfg, env, tokenizer, gen_spec)
    policy = LocalHandle.build("policy", {"train": (cfg.policy.train.engine, train_spec)})
    start = saves.restore(policy) if resumed is not None else 0
    logger.info(f"warm-up: {w.steps} SFT steps" + (f", continuing after step {start} ({saves.resume.name})"
                                                  if start else ""))
    t0 = time.time()
    for step in range(start, w.steps):
        if stop():
            logger.warning(f"warm-up stopped at step {step}/{w.steps}")
            if saves is not None and step:
                saves.save(step, policy, before)
            return model_dir, before
        m = policy.train_step(sft_batch(env, tokenizer, step * w.batch_size, w.batch_size), SFTLoss())
        if (step + 1) % max(1, w.steps // 10) == 0 or step + 1 == w.steps:
            logger.info(f"warm-up step {step + 1}/{w.steps} | nll {m['loss']:.3f} | "
                        f"token acc {m['sft/token_accuracy']:.2f} | {time.time() - t0:.0f}s")
            log({"warmup_step": step + 1, "warmup/nll": m["loss"], "warmup/token_accuracy": m["sft/token_accuracy"]})
        if saves is not None and (step + 1 == w.steps or saves.schedule.due(step + 1)):
            saves.save(step + 1, policy, before)  # the end too: a kill in the Ray start-up resumes after it
    path = out_dir / "warmup"
    policy.save_pretrained(str(path))
    return str(path), before


def _eval_before(cfg: XConfig, env: Env, tokenizer, gen_spec: EngineSpec) -> dict[str, float]:
    """The policy's eval metrics before the warm-up; none for an env scored by a reward model
    (it is not running yet)."""
    if env.reward_source == "model":
        return {}
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
    return before


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
