"""One on-policy step (``ppo_epochs: 1``, one mini-batch, no dropout, the KL a loss term) skips the
policy's old-logprob forward (``PolicyGradient.reuses_train_forward``): GRPO and PPO update
the weights as when the forward runs, and report the same metrics, from the train step."""

from __future__ import annotations

import random

import pytest
import torch

from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.base import Rollout
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFInferEngine, HFTrainEngine
from xrlhf.envs import build_env
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.utils.run_hooks import RunHooks

ROWS = 8


def make_trainer(model: str, algorithm: dict, skip: bool, monkeypatch):
    cfg = validate_dict({"env": {"name": "reasoning"}, "policy": {"model": model, "train": {"lr": 1e-3}},
                         "critic": {} if algorithm["name"] == "ppo" else None,
                         "algorithm": {"ppo_epochs": 1, "mini_batch_size": ROWS, "kl_coef": 0.05,
                                       "kl_in_reward": False, "kl_estimator": "k3", "tis_cap": 2.0, **algorithm},
                         "trainer": {"prompts_per_step": ROWS // 2, "samples_per_prompt": 2}})
    spec = lambda head: EngineSpec(model_path=model, head=head, seed=0,  # noqa: E731
                                   options={"lr": 1e-3, "micro_batch_size": ROWS})
    critic = LocalHandle.of("critic", train=HFTrainEngine(spec("value"))) if cfg.critic is not None else None
    handles = LocalHandles(LocalHandle.of("policy", train=HFTrainEngine(spec("causal_lm"))), critic=critic,
                           reference=LocalHandle.of("reference", infer=HFInferEngine(EngineSpec(model, seed=0))))
    trainer = build_trainer(cfg, algorithm_options(cfg), handles, build_env("reasoning", {}, 0), load_tokenizer(model),
                            reward=None, hooks=RunHooks())
    if not skip:
        monkeypatch.setattr(trainer.update, "reuses_train_forward", lambda batch: False)
    return trainer


def rollout(stale: bool) -> Rollout:
    rng = random.Random(0)
    batch = build_sequences([[1] + [rng.randrange(4, 90) for _ in range(rng.randint(1, 5))] for _ in range(ROWS)],
                            [[rng.randrange(4, 90) for _ in range(rng.randint(1, 6))] for _ in range(ROWS)], 0)
    g = torch.Generator().manual_seed(1)
    mask = batch["response_mask"]
    batch["scores"] = torch.rand(ROWS, generator=g)
    batch["group_ids"] = torch.arange(ROWS) // 2
    batch["rollout_logprobs"] = (-4.5 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    if stale:  # an asynchronous rollout: the rows' tokens sampled one or two versions back
        batch["token_versions"] = (torch.arange(ROWS) % 2).unsqueeze(1).expand_as(mask).clone() * mask.long()
    return Rollout(batch, [], [])


@pytest.mark.parametrize("name", ["grpo", "ppo"])
@pytest.mark.parametrize("stale", [False, True])
def test_an_on_policy_step_skips_the_old_logprob_forward_and_learns_the_same(tiny_model, monkeypatch, name, stale):
    results = {}
    for skip in (True, False):
        trainer = make_trainer(tiny_model, {"name": name}, skip, monkeypatch)
        trainer.step_idx = 2
        policy = trainer.policy.hosts[0].train
        calls = []
        real = policy.infer
        monkeypatch.setattr(policy, "infer", lambda batch: calls.append(len(batch)) or real(batch))
        metrics = trainer.update(rollout(stale), {})
        results[skip] = (metrics, dict(policy.named_weights()), calls)
    (skipped, w_skip, calls_skip), (full, w_full, calls_full) = results[True], results[False]
    assert calls_skip == [] and calls_full == [ROWS]  # the policy's forward without gradients: gone
    assert set(skipped) == set(full)  # every metric is still reported
    for k in full:  # the same numbers, within float noise (one micro-batch either way)
        assert skipped[k] == pytest.approx(full[k], rel=1e-5, abs=1e-6), k
    assert skipped["policy/ratio_mean"] == 1.0 and skipped["mismatch/logprob_abs_diff_mean"] > 0.1
    if stale:
        assert {"mismatch/abs_diff_s1", "mismatch/abs_diff_s2", "staleness/max"} <= set(skipped)
    for k, w in w_full.items():
        torch.testing.assert_close(w_skip[k], w, rtol=1e-5, atol=1e-7, msg=k)


def test_no_skip_where_the_old_policy_is_not_the_trained_one(tiny_model, monkeypatch):
    batch = rollout(False).batch
    for algorithm in ({"name": "grpo", "ppo_epochs": 2}, {"name": "grpo", "mini_batch_size": ROWS // 2},
                      {"name": "grpo", "kl_in_reward": True, "advantage_estimator": "reinforce_pp"},
                      {"name": "ppo", "kl_in_reward": True}):
        assert not make_trainer(tiny_model, algorithm, True, monkeypatch).update.reuses_train_forward(batch), algorithm
    assert make_trainer(tiny_model, {"name": "ppo", "kl_in_reward": True, "kl_coef": 0.0}, True,
                        monkeypatch).update.reuses_train_forward(batch)
