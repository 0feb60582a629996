"""Config checks of LoRA (``policy.train.lora``): the engine owns and validates the options, a bad
target is one line naming the model's linear layers (exit 2, no traceback), the reference is the
policy's base by default, and what a generate engine cannot take is said before anything starts."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from xrlhf.utils.errors import UserError
from xrlhf.validation import validate_dict

pytest.importorskip("peft")

LAYERS = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (lm_head: output heads are not adapted)"


def errors(config: dict) -> list[str]:
    with pytest.raises(UserError) as e:
        validate_dict(config)
    return e.value.messages


@pytest.fixture()
def lora_config(base_config) -> dict:
    cfg = copy.deepcopy(base_config)
    cfg["policy"]["train"]["lora"] = {"rank": 8, "alpha": 16, "target_modules": "all-linear"}
    return cfg


def test_a_bad_target_module_is_one_line_naming_the_models_linear_layers(lora_config, tiny_model):
    lora_config["policy"]["train"]["lora"]["target_modules"] = ["q_proj", "qproj"]
    assert errors(lora_config) == [f"policy.train.lora.target_modules: 'qproj' is not a linear layer of {tiny_model} "
                                   f"that LoRA can adapt; its linear layers: {LAYERS}; or all-linear"]
    lora_config["policy"]["train"]["lora"]["target_modules"] = ["lm_head"]
    assert errors(lora_config)[0].startswith("policy.train.lora.target_modules: 'lm_head' is not a linear layer")
    lora_config["critic"]["train"]["lora"] = {"target_modules": ["dense"]}
    lora_config["policy"]["train"]["lora"]["target_modules"] = ["q_proj", "v_proj"]
    assert [e.split(":")[0] for e in errors(lora_config)] == ["critic.train.lora.target_modules"]


def test_the_cli_exits_2_with_the_line_and_no_traceback(lora_config, tmp_path, tiny_model):
    lora_config["policy"]["train"]["lora"]["target_modules"] = ["qproj"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(lora_config))
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "validate", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: policy.train.lora.target_modules: 'qproj' is not a linear layer of {tiny_model} that LoRA can adapt; "
        f"its linear layers: {LAYERS}; or all-linear"]


def test_unknown_keys_and_values_are_rejected_under_their_path(lora_config):
    lora_config["policy"]["train"]["lora"].update(ranks=4, sync="merge", dropout=0.1)
    lines = errors(lora_config)
    assert "policy.train.lora.ranks: unknown key (valid: alpha, dropout, rank, save, sync, target_modules)" in lines
    assert any(x.startswith("policy.train.lora.sync: ") and "'merge'" in x for x in lines)
    del lora_config["policy"]["train"]["lora"]["ranks"], lora_config["policy"]["train"]["lora"]["sync"]
    assert errors(lora_config) == ["policy.train.lora.dropout: 0.1 needs policy.train.dropout: true (train engines run "
                                   "without dropout unless the section asks for it); set it to 0 or set dropout: true"]


def test_lora_on_an_engine_without_it_names_the_engines_that_have_it(lora_config):
    lora_config["policy"]["train"]["engine"] = "tests.config.test_lora_config:PlainTrainer"
    assert errors(lora_config) == ["policy.train.lora: an option of engine 'deepspeed' or 'hf', but policy.train.engine "
                                   "is 'tests.config.test_lora_config:PlainTrainer'; remove it or set "
                                   "policy.train.engine: deepspeed"]


def test_the_reference_is_the_policys_base_by_default(lora_config, base_config):
    from xrlhf.topology import handle_specs, reference_is_policy_base

    cfg = validate_dict(lora_config)
    assert reference_is_policy_base(cfg)
    assert [s.name for s in handle_specs(cfg, cfg.policy.model, {})] == ["policy", "rollout", "critic"]
    assert not reference_is_policy_base(validate_dict(base_config))  # full fine-tuning: a reference model
    off = validate_dict({**lora_config, "reference": {"from_policy_base": False, "infer": {"micro_batch_size": 4}}})
    assert [s.name for s in handle_specs(off, off.policy.model, {})] == ["policy", "rollout", "critic", "reference"]


def test_reference_settings_the_base_would_ignore_are_errors(lora_config, base_config):
    lora_config["reference"] = {"infer": {"micro_batch_size": 4}}
    assert errors(lora_config) == ["reference.infer: not used: the reference is the policy's base with its LoRA adapters "
                                   "off (policy.train.lora); remove it, or set reference.from_policy_base: false for a "
                                   "reference model of its own"]
    base_config["reference"] = {"from_policy_base": True}
    assert errors(base_config) == ["reference.from_policy_base: the policy trains every weight (no policy.train.lora), "
                                   "so it keeps no base to compute the reference with; remove it (the reference is "
                                   "then a model of its own)"]
    base_config["reference"] = {}
    base_config["warmup"] = {"steps": 2, "lora": True}
    assert errors(base_config) == ["warmup.lora: warms up with the policy's LoRA adapters, but policy.train has no lora "
                                   "section; remove it"]


def test_adapter_sync_needs_a_generator_that_loads_adapters(lora_config):
    from xrlhf.topology import handle_specs

    lora_config["policy"]["train"]["lora"]["sync"] = "adapter"
    assert errors(lora_config) == ["policy.train.lora.sync: 'adapter' sends the generator LoRA adapters, and generate "
                                   "engine HFGenerateEngine loads full weights only; set sync: merged (or use engine: "
                                   "vllm)"]
    lora_config["policy"]["train"]["lora"]["sync"] = "merged"
    cfg = validate_dict(lora_config)
    gen = handle_specs(cfg, cfg.policy.model, {})[1].engines["generate"][1]
    assert gen.adapter is None  # merged: the generator gets ordinary full weights


def test_vllm_takes_an_adapter_it_can_hold():
    from xrlhf.engines.lora import LoraOptions
    from xrlhf.engines.vllm import VLLMGenerateEngine, VLLMOptions, lora_rank

    opts = VLLMOptions(engine="vllm", sleep_level=1)
    assert VLLMGenerateEngine.adapter_errors(opts, LoraOptions(rank=16, sync="adapter")) == []
    lines = VLLMGenerateEngine.adapter_errors(opts.model_copy(update={"sleep_level": 2}),
                                              LoraOptions(rank=1000, sync="adapter"))
    assert [x.split(":")[0] for x in lines] == ["policy.train.lora.rank", "policy.generate.sleep_level"]
    assert [lora_rank(r) for r in (1, 4, 16, 17, 300)] == [1, 8, 16, 32, 320]


def test_vllm_is_started_with_lora_for_an_adapter_sync(tiny_model):
    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.lora import LoraOptions
    from xrlhf.engines.vllm import llm_kwargs

    kwargs, _ = llm_kwargs(EngineSpec(tiny_model, options={"engine": "vllm"}, adapter=LoraOptions(rank=12)))
    assert kwargs["enable_lora"] and kwargs["max_lora_rank"] == 16 and kwargs["max_loras"] == 1
    assert "enable_lora" not in llm_kwargs(EngineSpec(tiny_model, options={"engine": "vllm"}))[0]


def _plain_trainer():
    from xrlhf.engines.base import TrainOptions
    from xrlhf.engines.hf import HFTrainEngine

    return type("PlainTrainer", (HFTrainEngine,), {"Options": TrainOptions, "__module__": __name__})


PlainTrainer = _plain_trainer()
"""A user's train engine whose options have no ``lora``, named by import path."""
