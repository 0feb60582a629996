"""The one rollout path: every schedule and every kind of batch goes through one collector and one
producer, and versions are published in every mode, so staleness is right in every mode.

Real tiny-model engines in process (``LocalHandles``, no Ray). The bug this pins: a synchronous
run of an episode env (or with streamed rewards, or dynamic sampling) used to stamp tokens from a
generator left at version 0 (``staleness/max`` 0, 1, 2 ... for on-policy samples).
"""

from __future__ import annotations

import pytest

from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.algorithms.rewards import build_reward
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFGenerateEngine, HFTrainEngine
from xrlhf.envs import build_env
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.utils.run_hooks import RunHooks


def run(model_dir: str, env: dict, rollout: dict, steps: int = 3, eval_every: int = 0,
        generate: dict | None = None) -> list[dict]:
    cfg = validate_dict({
        "env": env, "reference": None, "rollout": rollout,
        "policy": {"model": model_dir, "train": {"lr": 1e-2, "micro_batch_size": 16},
                   "generate": {"max_new_tokens": 6, "temperature": 1.0, **(generate or {})}},
        "algorithm": {"name": "grpo", "mini_batch_size": 8, "kl_coef": 0.0,
                      **({"off_policy": {"correction": "tis"}} if rollout.get("max_staleness") else {})},
        "trainer": {"steps": steps, "prompts_per_step": 4, "samples_per_prompt": 2, "eval_every": eval_every,
                    "eval_size": 4}})
    train = HFTrainEngine(EngineSpec(model_path=model_dir, options={"lr": 1e-2, "micro_batch_size": 16}, seed=0))
    gen = HFGenerateEngine(EngineSpec(model_path=model_dir, options={"micro_batch_size": 16}, seed=0))
    handles = LocalHandles(LocalHandle.of("policy", train=train, generate=gen))
    environment = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    rows: list[dict] = []
    trainer = build_trainer(cfg, algorithm_options(cfg), handles, environment, load_tokenizer(model_dir),
                            reward=build_reward(cfg, environment, handles), hooks=RunHooks(log=rows.append))
    trainer.fit()
    assert gen.version == steps  # every step published its version, the synchronous loop too
    return [r for r in rows if "reward/mean" in r]


REASONING = {"name": "reasoning", "options": {"eval_size": 4}}
CALC = {"name": "calc", "options": {"eval_size": 4, "max_turns": 2, "max_episode_tokens": 24}}


@pytest.mark.parametrize("env,rollout", [
    (REASONING, {}),
    (REASONING, {"stream_rewards": True, "stream_parts": 2}),
    (REASONING, {"refill": {"name": "dynamic_sampling", "max_generated_factor": 2.0}}),
    (CALC, {}),
], ids=["plain", "streamed", "dynamic_sampling", "episodes"])
def test_a_synchronous_run_is_on_policy_at_every_step(tiny_model, env, rollout):
    steps = run(tiny_model, env, rollout, eval_every=2)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # the batch of step s was sampled by version s - 1 exactly
        assert r["staleness/min"] == r["staleness/max"] == 0, r["step"]
        assert r["time/wait_generation_s"] >= 0 and "time/sleep_s" in r and "time/sync_s" in r
    if env is CALC:
        assert "episode/turns_mean" in steps[0]
    if "refill" in rollout:
        assert all("sampling/generated_groups" in r for r in steps)
    # what each step trained on (its row's ``prompts``): a group per prompt, no prompt twice
    prompts = [r["prompts"] for r in steps]
    assert [len(p) for p in prompts] == [4, 4, 4] and len({i for p in prompts for i in p}) == 12
    if "refill" not in rollout:  # one round per batch: the next 4 prompts of the stream
        assert prompts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_one_step_off_lags_by_one_version_at_most(tiny_model):
    steps = run(tiny_model, REASONING, {"max_staleness": 1}, steps=4)
    assert [r["staleness/max"] for r in steps] == [0, 1, 1, 1]
    assert [r["prompts"] for r in steps] == [list(range(4 * s, 4 * s + 4)) for s in range(4)]
    assert all(r["staleness/min"] >= 0 for r in steps)


def test_logprobs_are_asked_for_only_where_read_or_free(tiny_model):
    """vLLM's per-token logprobs cost throughput: a rollout asks for them only when the update
    weighs by them (truncated IS, an off-policy correction); the Transformers engine's are free
    and kept for the mismatch metric. An evaluation never asks."""
    from xrlhf.algorithms import ALGORITHMS
    from xrlhf.algorithms.rollout.build import rollout_sampling
    from xrlhf.config.schema import XConfig

    def sampled(engine: str, **algorithm) -> bool:
        cfg = XConfig.model_validate({"env": REASONING, "reference": None,
                                      "policy": {"model": tiny_model, "generate": {"engine": engine}},
                                      "algorithm": {"name": "grpo", "kl_coef": 0.0, **algorithm}})
        options = algorithm_options(cfg)
        return rollout_sampling(cfg, ALGORITHMS.get("grpo").reads_behaviour_logprobs(cfg, options)).params.logprobs

    assert not sampled("vllm") and sampled("vllm", tis_cap=2.0) and sampled("vllm", off_policy={"correction": "none"})
    assert sampled("hf")
