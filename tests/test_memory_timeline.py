"""The memory timeline's figures from hand-made stats (the e2e PPO run checks real ones)."""

from __future__ import annotations

from xrlhf.algorithms.build import memory_timeline_on
from xrlhf.utils.memory import memory_metrics, memory_table
from xrlhf.validation import validate_dict


def test_metrics_take_each_handles_largest_rank_and_the_device():
    gpu = {"policy": [{"max_allocated_gb": 10.0, "rss_gb": 3.0, "device_used_gb": 40.0},
                      {"max_allocated_gb": 12.5, "rss_gb": 3.0, "device_used_gb": 41.0}],
           "reference": [{"max_allocated_gb": 1.25, "rss_gb": 2.0, "device_used_gb": 40.5}]}
    assert memory_metrics("train", gpu) == {"memory/train/policy_gib": 12.5, "memory/train/reference_gib": 1.25,
                                            "memory/train/device_gib": 41.0}
    gpu["policy"][1]["alloc_retries"] = 2  # a full device during the phase: counted where it happened
    gpu["reference"][0]["alloc_retries"] = 0
    assert memory_metrics("train", gpu)["memory/train/policy_retries"] == 2.0
    assert "memory/train/reference_retries" not in memory_metrics("train", gpu)
    cpu = {"policy": [{"rss_gb": 1.5}], "critic": [{"rss_gb": 0.75}]}
    assert memory_metrics("sync", cpu) == {"memory/sync/policy_gib": 1.5, "memory/sync/critic_gib": 0.75}


def test_table_is_the_mean_over_steps_in_phase_order():
    rows = [{"step": 1, "memory/train/policy_gib": 2.0, "memory/generate/policy_gib": 1.0,
             "memory/generate/device_gib": 5.0},
            {"step": 2, "memory/train/policy_gib": 4.0, "memory/generate/policy_gib": 1.0,
             "memory/generate/device_gib": 7.0}]
    phases, names, means = memory_table(rows)
    assert phases == ["generate", "train"] and names == ["policy", "device"]
    assert means == {("train", "policy"): 3.0, ("generate", "policy"): 1.0, ("generate", "device"): 6.0}


def test_on_by_default_only_with_a_gpu(base_config):
    assert not memory_timeline_on(validate_dict(base_config))
    base_config["logging"] = {"memory_timeline": True}
    assert memory_timeline_on(validate_dict(base_config))
