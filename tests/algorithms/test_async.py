"""The asynchronous rollout in process, on real tiny-model engines (``LocalHandles``, no Ray):
in-flight weight updates under ``latest`` freshness, dynamic sampling's counts and cap,
streamed scoring, and the keyed batch being independent of how it is streamed."""

from __future__ import annotations

import pytest
import torch

from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.algorithms.rewards import build_reward
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFGenerateEngine, HFTrainEngine
from xrlhf.envs import build_env
from xrlhf.models.tiny import build_model
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.utils.run_hooks import RunHooks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


def make_trainer(model_dir, rollout: dict, algorithm: dict | None = None, trainer: dict | None = None,
                 reward=None, log=None):
    cfg = validate_dict({
        "env": {"name": "reasoning", "options": {"eval_size": 8}},
        "policy": {"model": model_dir, "train": {"lr": 1e-2, "micro_batch_size": 16},
                   "generate": {"max_new_tokens": 6, "temperature": 1.0}},
        "algorithm": {"name": "grpo", "mini_batch_size": 16, "off_policy": {"correction": "tis"}, **(algorithm or {})},
        "rollout": rollout, "reference": None,
        "trainer": {"steps": 4, "prompts_per_step": 4, "samples_per_prompt": 4, **(trainer or {})}})
    train = HFTrainEngine(EngineSpec(model_path=model_dir, options={"lr": 1e-2, "micro_batch_size": 16}, seed=0))
    gen = HFGenerateEngine(EngineSpec(model_path=model_dir, options={"micro_batch_size": 16}, seed=0))
    handles = LocalHandles(LocalHandle.of("policy", train=train, generate=gen))
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    reward = reward or build_reward(cfg, env, handles)
    return build_trainer(cfg, algorithm_options(cfg), handles, env, load_tokenizer(model_dir),
                         reward=reward, hooks=RunHooks(log=log or (lambda m: None)))


def test_latest_with_in_flight_updates_stamps_every_token(model_dir):
    rows = []
    trainer = make_trainer(model_dir, {"max_staleness": 2, "freshness": "latest", "in_flight_updates": True,
                                       "on_update": "recompute"}, log=rows.append)
    trainer.fit()
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # never more than k versions behind, never ahead of the trained policy
        assert 0 <= r["staleness/min"] <= r["staleness/max"] <= 2
        assert 0 <= r["staleness/mixed_frac"] <= 1  # > 0 when a sync landed mid-sample: timing decides
    assert any("mismatch/abs_diff_s0" in r for r in steps)


def test_dynamic_sampling_counts_and_cap(model_dir):
    seen = {"groups": 0, "uniform": False}

    def reward(prompts, responses, batch):
        """Groups 0, 2, 4, ... get mixed rewards (kept), the others equal ones (dropped)."""
        n = 4
        scores = []
        for g in range(len(prompts) // n):
            mixed = seen["groups"] % 2 == 0 and not seen["uniform"]
            scores += [float(j % 2) if mixed else 1.0 for j in range(n)]
            seen["groups"] += 1
        return torch.tensor(scores), {}

    trainer = make_trainer(model_dir, {"refill": {"name": "dynamic_sampling", "max_generated_factor": 3.0},
                                       "stream_rewards": True, "stream_parts": 2}, reward=reward)
    rollout, pos = trainer.collector(1, 0, lambda: None)
    # round 1: 4 prompts, groups 0..3 -> 0, 2 kept; round 2: 2 prompts (4, 5) -> 4 kept; round 3: 1 (6) -> kept
    assert rollout.metrics["sampling/generated_groups"] == 7 and pos == 7
    assert rollout.metrics["sampling/kept_fraction"] == pytest.approx(4 / 7)
    assert rollout.metrics["sampling/filled_groups"] == 0
    assert rollout.batch["group_ids"].tolist() == [g for g in range(4) for _ in range(4)]
    assert all(rollout.batch["scores"][4 * g:4 * g + 4].std() > 0 for g in range(4))

    seen["uniform"] = True  # now every group is uniform: the cap (2 x 4 groups) stops it, the batch is filled
    trainer.collector.refill.options.max_generated_factor = 2.0
    rollout, pos = trainer.collector(2, pos, lambda: None)
    assert rollout.metrics["sampling/generated_groups"] == 8 and pos == 15
    assert rollout.metrics["sampling/filled_groups"] == 4 and rollout.metrics["sampling/kept_fraction"] == 0
    assert len(rollout.batch) == 16  # always a full batch: the last 4 dropped groups


def test_a_keyed_batch_does_not_depend_on_how_it_is_streamed(model_dir):
    one = make_trainer(model_dir, {"max_staleness": 1, "stream_parts": 1})
    four = make_trainer(model_dir, {"max_staleness": 1, "stream_parts": 4})
    a, _ = one.collector(3, 8, lambda: None)
    b, _ = four.collector(3, 8, lambda: None)
    assert torch.equal(a.batch["input_ids"], b.batch["input_ids"])
    assert torch.allclose(a.batch["rollout_logprobs"], b.batch["rollout_logprobs"], atol=1e-5)
    assert torch.equal(a.batch["scores"], b.batch["scores"])
    assert a.responses == b.responses
