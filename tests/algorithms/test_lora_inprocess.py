"""GRPO with a LoRA policy in process (``LocalHandles``): the reference is the policy's own base
(``LocalHandle.base_reference``: no second model), the KL starts at zero, the reference stays the
start model while the adapters learn, and each sync hands the generator the merged weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.local import LocalHandle, LocalHandles  # noqa: E402
from xrlhf.algorithms.rewards import build_reward  # noqa: E402
from xrlhf.data.batch import build_sequences  # noqa: E402
from xrlhf.data.text import encode_prompt, load_tokenizer  # noqa: E402
from xrlhf.engines.base import EngineSpec  # noqa: E402
from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine, HFTrainEngine  # noqa: E402
from xrlhf.envs import build_env  # noqa: E402
from xrlhf.validation import algorithm_options, validate_dict  # noqa: E402
from xrlhf.weight_sync import checksum, compare_checksums  # noqa: E402
from xrlhf.utils.run_hooks import RunHooks


def length_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Rewards that differ within a group from the first step (the untrained model is never right)."""
    return [float(len(r)) for r in responses]


def test_grpo_with_lora_uses_the_policys_base_as_reference(tiny_model):
    lora = {"rank": 4, "alpha": 16}
    cfg = validate_dict({"env": {"name": "reasoning", "options": {"eval_size": 8}},
                         "reward": {"source": "function", "function": f"{__name__}:length_reward"},
                         "policy": {"model": tiny_model, "train": {"lr": 1e-2, "lora": lora},
                                    "generate": {"max_new_tokens": 4}},
                         "reference": {}, "algorithm": {"name": "grpo", "mini_batch_size": 8, "kl_coef": 0.1},
                         "trainer": {"steps": 3, "prompts_per_step": 4, "samples_per_prompt": 2}})
    train = HFTrainEngine(EngineSpec(tiny_model, options={"lr": 1e-2, "micro_batch_size": 8, "lora": lora}, seed=0))
    gen = HFGenerateEngine(EngineSpec(tiny_model, seed=0))
    policy = LocalHandle.of("policy", train=train, generate=gen)
    handles = LocalHandles(policy, reference=policy.base_reference())
    assert handles.reference.hosts == policy.hosts and not handles.reference.trainable  # no model of its own
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    tok = load_tokenizer(tiny_model)
    trainer = build_trainer(cfg, algorithm_options(cfg), handles, env, tok, build_reward(cfg, env, handles),
                            RunHooks())
    first = trainer.step()
    assert abs(first["kl/mean"]) < 1e-6  # policy == reference until the first update lands
    for _ in range(2):
        trainer.step()

    prompts = [encode_prompt(tok, p.text) for p in env.eval_prompts()]
    batch = build_sequences(prompts, [[5, 6, 2]] * len(prompts), tok.pad_token_id)
    base = HFInferEngine(EngineSpec(tiny_model)).infer(batch)["logprobs"]
    assert torch.equal(handles.reference.infer(batch)["logprobs"], base)  # the start model, bit for bit
    assert not torch.equal(policy.infer(batch)["logprobs"], base)  # while the adapters have learnt
    compare_checksums({n: checksum(t) for n, t in train.named_weights()},  # the generator holds the merged weights
                      {n: checksum(t) for n, t in gen.model.state_dict().items()})


@pytest.mark.parametrize("lora_warmup", [False, True])
def test_the_warmup_writes_a_whole_model_for_the_adapters_to_start_on(tiny_model, tmp_path, lora_warmup):
    from safetensors.torch import load_file

    from xrlhf.algorithms.warmup import supervised_warmup, warmup_specs

    cfg = validate_dict({"env": {"name": "reasoning", "options": {"eval_size": 8}},
                         "policy": {"model": tiny_model, "train": {"lr": 1e-3, "lora": {"rank": 4, "save": "adapter"}},
                                    "generate": {"max_new_tokens": 4}},
                         "warmup": {"steps": 3, "batch_size": 8, "lora": lora_warmup},
                         "algorithm": {"name": "grpo", "mini_batch_size": 8, "kl_coef": 0.0}, "reference": None,
                         "trainer": {"prompts_per_step": 4, "samples_per_prompt": 2}})
    train_spec, _ = warmup_specs(cfg, tiny_model)
    lora = train_spec.options.lora
    assert (lora is not None and lora.save == "merged") if lora_warmup else lora is None
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    path, _ = supervised_warmup(cfg, env, load_tokenizer(tiny_model), tiny_model, tmp_path)
    weights = load_file(f"{path}/model.safetensors")  # a whole model either way, not an adapter
    base = HFInferEngine(EngineSpec(tiny_model)).hf.model.state_dict()
    assert set(weights) <= set(base) and not any("lora" in k for k in weights)
    assert any(not torch.equal(weights[k], base[k]) for k in weights)
