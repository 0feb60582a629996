"""The planner asks a backend's engine class (``plan.backends``), so a user's class by import path
is planned from its own attributes, and the advice names the backend that can shard."""

from __future__ import annotations

from xrlhf.engines.hf import HFGenerateEngine, HFTrainEngine
from xrlhf.plan.backends import (
    as_args,
    paged,
    shard_overrides,
    sharding,
    sleep_levels,
    zero_stage,
)
from xrlhf.plan.memory import Generator, Trainer

HERE = "tests.plan.test_backends"


class SleepyGenerator(HFGenerateEngine):
    """A user's generator that sleeps (one level) and is planned with a paged KV cache."""

    sleep_levels = (1, 0)
    memory_model = "paged"


class MyTrainer(HFTrainEngine):
    """A user's trainer that keeps every default of the Transformers one."""


def test_a_users_generator_is_planned_from_its_class():
    assert sleep_levels(f"{HERE}:SleepyGenerator") == (1, 0)
    assert paged(Generator(engine=f"{HERE}:SleepyGenerator"))
    assert sleep_levels("hf") == (0,) and not paged(Generator(engine="hf"))
    assert sleep_levels("vllm") == (2, 1, 0) and paged(Generator(engine="vllm"))


def test_the_zero_stage_counts_only_for_a_backend_that_partitions():
    assert zero_stage(Trainer(engine="deepspeed", zero_stage=3)) == 3
    assert zero_stage(Trainer(engine="hf", zero_stage=3)) == 0
    assert zero_stage(Trainer(engine=f"{HERE}:MyTrainer", zero_stage=3)) == 0


def test_sharding_is_proposed_by_the_backend_that_can():
    assert sharding("deepspeed", "train", 2) == ("deepspeed", {"zero_stage": 2})
    assert sharding(f"{HERE}:MyTrainer", "train", 3) == ("deepspeed", {"zero_stage": 3})
    assert sharding("hf", "infer", 2) is None  # DeepSpeed's infer engine: ZeRO 0 or 3 only
    assert as_args(shard_overrides("policy.train", "hf", "train", 3, offload=True)) == (
        "policy.train.engine=deepspeed policy.train.zero_stage=3 policy.train.offload_optimizer=true")
    assert shard_overrides("reference.infer", "hf", "infer", 3) == {
        "reference.infer.engine": "deepspeed", "reference.infer.zero_stage": 3}
