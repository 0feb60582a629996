"""``xrlhf make-completions``: a model's completions of an env's training prompts, as a dataset.

Why: distillation's off-policy half (``algorithm.offline_dataset``, GKD's mixed data) trains on a
teacher's own samples; this writes them as ``{prompt, completion}`` rows with the model, the env
and the sampling of a config, in this process (an ``hf`` generate engine: a teacher that fits one
device; no Ray). Each completion is sampled from its own seed (``utils.seeds``), so the file is a
function of the model, the config and the arguments.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loguru import logger

from xrlhf.utils.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a run config: its env and policy.generate (temperature, max_new_tokens) are used")
    p.add_argument("model", help="the HF model directory that completes the prompts (a distillation's teacher)")
    p.add_argument("out", help="the JSONL file to write")
    p.add_argument("--count", type=int, default=4096, help="training prompts completed, from the env's first")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the config")


def run(args: argparse.Namespace) -> int:
    from xrlhf.algorithms.rollout import sampling_params
    from xrlhf.config.schema import check_model_dir
    from xrlhf.data.datasets import write_jsonl
    from xrlhf.data.text import decode_responses, encode_prompt, load_tokenizer
    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.hf import HFGenerateEngine
    from xrlhf.envs import build_env
    from xrlhf.envs.episode import is_episode_env
    from xrlhf.utils.seeds import sample_seed
    from xrlhf.validation import load_config

    cfg = load_config(args.config, args.overrides)
    try:
        model = check_model_dir(args.model)
    except ValueError as e:
        raise UserError(f"model: {e}") from None
    if args.count < 1:
        raise UserError(f"--count: {args.count}; complete at least one prompt")
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    if is_episode_env(env):
        raise UserError(f"env.name: env {cfg.env.name!r} runs episodes; completions are one-turn rows")
    tok = load_tokenizer(model)
    g = cfg.policy.generate
    engine = HFGenerateEngine(EngineSpec(model_path=model, seed=cfg.seed, temperature=g.temperature or 1.0,
                                         options={"max_new_tokens": g.max_new_tokens}))
    rows, batch = [], 256
    for start in range(0, args.count, batch):
        prompts = env.train_prompts(start, min(batch, args.count - start))
        ids = [encode_prompt(tok, p) for p in prompts]
        seeds = [sample_seed(cfg.seed, -2, start + i) for i in range(len(ids))]  # -2: a stream of its own
        out = engine.generate(ids, sampling_params(cfg, logprobs=False), seeds)
        texts = decode_responses(tok, out.token_ids)
        rows += [{"prompt": p.text, "completion": t} for p, t in zip(prompts, texts)]
    path = write_jsonl(rows, Path(args.out))
    logger.info(f"wrote {len(rows)} completions of {model} to {path}")
    return 0
