"""A generator killed in the middle of a weight sync, in both layouts. Its own module: the
split layout's module holds every CPU of the tests' Ray while its coordinator lives."""

from __future__ import annotations

import pytest

from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.coordinator import Coordinator
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import SamplingParams
from xrlhf.topology import topology
from xrlhf.validation import validate_dict
from xrlhf.weight_sync import compare_checksums

from tests.conftest import policy_batch as batch

pytestmark = pytest.mark.usefixtures("ray_session")  # runs handles in this process

ONE_RANK = {"ranks": 1, "cpus_per_rank": 0.5}
"""One worker on half a CPU: the policy's, and the generators' own in the split layout."""


def started(tiny_model: str, layout: str, transport: str) -> Coordinator:
    """A started coordinator of a small GRPO run: one policy rank, generators co-located or split,
    weights by ``transport`` (verified, 1 MiB buckets)."""
    gen = {"max_new_tokens": 3, **({"resources": ONE_RANK} if layout == "split" else {})}
    cfg = validate_dict({
        "name": "heal-sync", "seed": 0, "ray": {"num_cpus": 2},
        "env": {"name": "reasoning", "options": {"eval_size": 8}},
        "policy": {"model": tiny_model, "train": {"lr": 1e-3, "micro_batch_size": 8}, "generate": gen,
                   "resources": ONE_RANK, "weight_sync": {"transport": transport, "verify": True, "bucket_mb": 1}},
        "reference": None, "algorithm": {"name": "grpo", "mini_batch_size": 8, "kl_coef": 0.0},
        "trainer": {"steps": 2, "prompts_per_step": 4, "samples_per_prompt": 2}})
    return Coordinator(topology(cfg, tiny_model, {"policy": 2})).start()


@pytest.mark.parametrize("layout", [pytest.param("co-located", marks=pytest.mark.long), "split"])  # co-located: make test-all
def test_a_generator_killed_during_a_sync_is_synced_whole_and_generates(tiny_model, layout):
    """A generator that dies in the middle of a sync is restarted in place and synced whole by the
    coordinator; the interrupted sync's own steps are not sent again (a bucket sent twice, without
    its sync's end, left the generator waiting for ever: its next generate hung until the rollout's
    stall time-out). Its next generate answers, with the trainer's weights."""
    import ray

    coord = started(tiny_model, layout, "cpu")
    try:
        policy, rollout = coord["policy"], coord["rollout"]
        policy.train_step(batch(load_tokenizer(tiny_model)), PolicyLoss(entropy_coef=0.01))
        ray.kill(rollout.workers[0], no_restart=True)  # dies; the sync's first call to it finds out
        coord.sync_weights(1)
        assert [e["handle"] for e in coord.healing.events] == ["rollout"]
        compare_checksums(policy.weight_checksums("train")[0], rollout.weight_checksums("generate")[0])
        out = rollout.generate([[1, 20, 21]], SamplingParams(temperature=0, max_new_tokens=3), [7], wait=False)
        got = out.get(timeout=120)  # answers: not held back by a half-finished sync
        assert len(got.token_ids) == 1 and got.versions[0] and set(got.versions[0]) == {1}
        assert len(coord.healing.events) == 1, coord.healing.events  # (held back, it is restarted again)
    finally:
        coord.shutdown()


def test_a_broadcast_generator_killed_between_syncs_is_restarted_alone(tiny_model):
    """Split layout, weights by broadcast (``nccl``; gloo on CPU): a generator that dies between
    syncs is restarted in place; the group is opened anew with the new generator and the
    trainer's weights synced whole. The next generate answers, with the trainer's version."""
    import ray

    coord = started(tiny_model, "split", "nccl")
    try:
        policy, rollout = coord["policy"], coord["rollout"]
        assert coord.transport == "nccl"
        policy.train_step(batch(load_tokenizer(tiny_model)), PolicyLoss(entropy_coef=0.01))
        coord.sync_weights(1)
        ray.kill(rollout.workers[0], no_restart=True)  # dies between syncs; the generate finds out
        out = rollout.generate([[1, 20, 21]], SamplingParams(temperature=0, max_new_tokens=3), [7], wait=False)
        got = out.get(timeout=300)
        assert [(e["handle"], e["how"]) for e in coord.healing.events] == [("rollout", "in place")]
        assert len(got.token_ids) == 1 and set(got.versions[0]) == {1}
        compare_checksums(policy.weight_checksums("train")[0], rollout.weight_checksums("generate")[0])
    finally:
        coord.shutdown()
