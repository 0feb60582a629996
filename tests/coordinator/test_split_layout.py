"""The split (disaggregated) layout on CPU: the generators are their own 'rollout' handle and
get the trainer's weights by the object store (cpu), by broadcast (nccl, over gloo on CPU) or
by safetensors files in a shared directory (disk), with verify on. One Ray start serves every test of the module (Ray starts slowly)."""

from __future__ import annotations

import os

import pytest

from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.algorithms.rewards import build_reward
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.coordinator import Coordinator
from xrlhf.topology import topology, weight_sync_plan
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import SamplingParams
from xrlhf.envs import build_env
from xrlhf.weight_sync import WeightSyncError, compare_checksums

from tests.conftest import policy_batch as batch
from xrlhf.utils.run_hooks import RunHooks

pytestmark = pytest.mark.usefixtures("ray_session")  # runs handles in this process



@pytest.fixture(scope="module")
def split_run(tiny_model):
    """A started coordinator: policy (1 rank) with critic and reference, rollout (2 ranks)."""
    data = {
        "name": "split", "seed": 0, "ray": {"num_cpus": 2},
        "env": {"name": "reasoning", "options": {"eval_size": 8}},
        "policy": {"model": tiny_model, "train": {"lr": 1e-3, "micro_batch_size": 8},
                   "generate": {"max_new_tokens": 4, "resources": {"ranks": 2, "cpus_per_rank": 0.5}},
                   "resources": {"ranks": 1, "cpus_per_rank": 1},
                   "weight_sync": {"transport": "cpu", "verify": True, "bucket_mb": 1}},
        "critic": {"train": {"lr": 1e-3, "micro_batch_size": 8}}, "reference": {},
        "algorithm": {"name": "ppo", "mini_batch_size": 8, "kl_coef": 0.05},
        "trainer": {"steps": 2, "prompts_per_step": 8},
    }
    cfg = validate_dict(data)
    coord = Coordinator(topology(cfg, tiny_model, {"policy": 4, "critic": 4})).start()
    yield cfg, coord
    coord.shutdown()


@pytest.mark.parametrize("transport", ["cpu", "nccl", "disk"])
def test_after_a_sync_every_generator_holds_the_trainers_weights(split_run, tiny_model, transport, tmp_path):
    cfg, coord = split_run
    if coord.transport != transport:  # re-wire the same workers with the other transport
        cfg.policy.weight_sync = {"transport": transport, "verify": True, "bucket_mb": 1,
                                  **({"directory": str(tmp_path)} if transport == "disk" else {})}
        coord.topology.weight_sync = weight_sync_plan(cfg)
        coord._wire_weight_sync()
    policy, rollout = coord["policy"], coord["rollout"]
    assert coord.transport == transport and coord.generator is rollout and rollout.world_size == 2
    assert set(coord.specs[0].engines) == {"train"}  # the policy has no generator of its own
    for _ in range(2):  # a second sync reuses the broadcast group
        policy.train_step(batch(load_tokenizer(tiny_model)), PolicyLoss(entropy_coef=0.01))
        want = policy.weight_checksums("train")[0]
        with pytest.raises(WeightSyncError):
            compare_checksums(want, rollout.weight_checksums("generate")[0])
        assert coord.sync_weights() > 0
        for got in rollout.weight_checksums("generate"):
            compare_checksums(want, got)
        if transport == "disk":  # one bucket (bucket_mb 1): the sync before's file is gone
            assert len(os.listdir(tmp_path)) == 1 and os.listdir(tmp_path)[0].endswith(".safetensors")
    out = coord.generator.generate([[1, 20, 21]] * 2, SamplingParams(temperature=0, max_new_tokens=3))
    assert len(out.token_ids) == 2 and out.token_ids[0] == out.token_ids[1]


def test_ppo_runs_in_the_split_layout(split_run, tiny_model):
    cfg, coord = split_run
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    rows = []
    trainer = build_trainer(cfg, algorithm_options(cfg), coord, env, load_tokenizer(tiny_model),
                            build_reward(cfg, env, coord), RunHooks(log=rows.append))
    coord.sync_weights()  # earlier tests trained the policy: start the run in sync
    trainer.fit()
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["time/sync_s"] > 0 and "time/sleep_s" in r and r["time/generate_s"] > 0
        assert abs(r["mismatch/logprob_abs_diff_mean"]) < 1e-4  # the generators had the trainer's weights
