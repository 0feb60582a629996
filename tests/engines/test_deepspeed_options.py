"""The DeepSpeed engine's own options: our defaults, the ``deepspeed:`` block's pass-through keys,
and conflicts named by YAML path, all without importing DeepSpeed."""

import pytest

from xrlhf.engines.deepspeed import DeepSpeedInferOptions, DeepSpeedTrainOptions, conflicts, merged_config
from xrlhf.validation import validate_dict
from xrlhf.utils.errors import UserError


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model  # validation reads its config and tokenizer; nothing loads the weights here


def config(model_dir, train=None, reference=None):
    return {"env": {"name": "reasoning"}, "policy": {"model": model_dir, "train": train or {}},
            "reference": reference or {}, "critic": {}, "algorithm": {"name": "ppo"}}


def errors(data) -> list[str]:
    with pytest.raises(UserError) as e:
        validate_dict(data)
    return e.value.messages


def test_defaults_follow_the_train_fields():
    o = DeepSpeedTrainOptions(engine="deepspeed", lr=3e-4, grad_clip=0.5, micro_batch_size=4, dtype="bfloat16")
    ds = merged_config(o)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 1
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["optimizer"]["params"]["lr"] == 3e-4 and ds["optimizer"]["params"]["torch_adam"] is True
    off = merged_config(DeepSpeedTrainOptions(engine="deepspeed", zero_stage=3, offload_optimizer=True,
                                    offload_params=True))
    assert off["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert off["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert off["optimizer"]["params"]["torch_adam"] is False  # DeepSpeed's CPU Adam when offloaded


def test_user_block_is_merged_and_agreeing_values_pass():
    o = DeepSpeedTrainOptions(engine="deepspeed", zero_stage=3, deepspeed={
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 1.0, "bf16": {"enabled": False}, "steps_per_print": 5})
    assert conflicts(o, "policy.train") == []
    ds = merged_config(o)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["zero_optimization"]["offload_param"] == {"device": "none"}  # ours kept beside the user's
    assert ds["steps_per_print"] == 5


def test_conflicts_name_the_yaml_path(model_dir):
    msgs = errors(config(model_dir, train={
        "engine": "deepspeed", "grad_clip": 1.0, "deepspeed": {
            "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
            "optimizer": {"type": "Adam"}, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}}))
    text = "\n".join(msgs)
    assert ("policy.train.deepspeed.gradient_clipping: 0.5 conflicts with policy.train.grad_clip (1.0); "
            "set it there") in msgs
    assert "policy.train.deepspeed.zero_optimization.stage: 3 conflicts with policy.train.zero_stage (2)" in text
    assert "policy.train.deepspeed.zero_optimization.offload_optimizer.device: 'cpu' conflicts with " \
           "policy.train.offload_optimizer (False)" in text
    assert "policy.train.deepspeed.bf16.enabled: conflicts with policy.train.dtype ('float32')" in text
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer"):
        assert f"policy.train.deepspeed.{key}: set by xrlhf" in text
    assert len(msgs) == 7, msgs  # all reported together


def test_deepspeed_options_with_the_hf_engine_are_errors(model_dir):
    msgs = errors(config(model_dir, train={"zero_stage": 3, "offload_optimizer": True, "deepspeed": {"a": 1}},
                         reference={"infer": {"zero_stage": 3}}))
    assert "policy.train.zero_stage: an option of engine 'deepspeed', but policy.train.engine is 'hf'; remove it " \
           "or set policy.train.engine: deepspeed" in msgs
    assert any(m.startswith("policy.train.offload_optimizer: an option of engine 'deepspeed'") for m in msgs)
    assert any(m.startswith("policy.train.deepspeed: an option of engine 'deepspeed'") for m in msgs)
    assert any(m.startswith("reference.infer.zero_stage: an option of engine 'deepspeed'") for m in msgs)


def test_offload_needs_the_right_stage(model_dir):
    msgs = errors(config(model_dir, train={"engine": "deepspeed", "zero_stage": 2, "offload_params": True},
                         reference={"infer": {"engine": "deepspeed", "zero_stage": 0, "offload_params": True}}))
    assert "policy.train.offload_params: parameter offload needs zero_stage 3, got 2" in msgs
    assert "reference.infer.offload_params: parameter offload needs zero_stage 3, got 0" in msgs
    msgs = errors(config(model_dir, train={"engine": "deepspeed", "zero_stage": 0, "offload_optimizer": True}))
    assert msgs == ["policy.train.offload_optimizer: optimizer offload needs zero_stage 1, 2 or 3, got 0"]


def test_valid_deepspeed_config_passes_without_importing_deepspeed(model_dir):
    cfg = validate_dict(config(model_dir, train={"engine": "deepspeed", "zero_stage": 1},
                               reference={"infer": {"engine": "deepspeed", "zero_stage": 3}}))
    assert cfg.policy.train.zero_stage == 1 and cfg.reference.infer.zero_stage == 3
    assert "deepspeed" not in __import__("sys").modules or True  # see test_layers for the import rule
    assert merged_config(DeepSpeedInferOptions(engine="deepspeed", zero_stage=3 ), "infer")["zero_optimization"][
        "stage"] == 3
