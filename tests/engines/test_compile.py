"""``compile: true``: the decoder layers compiled (regional torch.compile) give the eager numbers,
packed (varlen attention with no graph break), padded, with LoRA (PEFT's wrapper around the
layers) and with mixed precision (bf16 weights, fp32 masters), in training and inference; what it
cannot serve is refused."""

from __future__ import annotations

import os

import pytest
import torch

from tests.engines.test_packing import grads_of_step, rl_batch
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import attention
from xrlhf.engines.hf.compiling import layer_stack
from xrlhf.engines.hf import HFTrainEngine, HFTrainOptions


def engine(model_dir, **options):
    return HFTrainEngine(EngineSpec(model_dir, head="causal_lm", temperature=0.8, seed=0,
                                    options={"micro_batch_size": 5, "lr": 1e-3, **options}))


# Packed rows with no LoRA are the lora case less PEFT's wrapper (the same varlen kernel, the same
# tolerance), so they are not a case of their own: each case is a minute of compiling on CI.
CASES = {"padded": {"packing": "off"},
         "lora": {"max_tokens_per_micro_batch": 30, "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear"}},
         "mixed_precision": {"max_tokens_per_micro_batch": 30, "dtype": "bfloat16", "mixed_precision": True}}
TOLERANCE = {"mixed_precision": 1e-3}  # bf16 weights: the fused kernels round at other places


@pytest.mark.slow  # torch.compile of every layout: tens of seconds
@pytest.mark.parametrize("case", [c if c == "padded" else pytest.param(c, marks=pytest.mark.long) for c in CASES])
# one case in make test; the others over a minute beside a busy core each: make test-all (CI) runs them
def test_compiled_layers_give_the_eager_step(tiny_model, case):
    layout, tol = CASES[case], TOLERANCE.get(case, 1e-6)
    from torch._dynamo.utils import counters

    batch = rl_batch(12, seed=1)
    loss = lambda: PolicyLoss(clip_eps=0.2, entropy_coef=0.01, kl_coef=0.05, kl_estimator="k3")  # noqa: E731
    eager = engine(tiny_model, **layout)
    want, want_grads = grads_of_step(eager, batch, loss())
    torch.compiler.reset()  # earlier tests' cached graphs (or their recompile count) would hide this one
    counters.clear()
    compiled = engine(tiny_model, compile=True, **layout)
    assert "2 x LlamaDecoderLayer compiled" in compiled.hf.prepare()
    attention.TAKEN.clear()
    got, grads = grads_of_step(compiled, batch, loss())
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    # the compiled layers record the kernel they ran as the eager ones do (dynamo replays the write)
    assert bool(attention.TAKEN) == (case != "padded"), attention.TAKEN
    assert grads.keys() == want_grads.keys()
    tokens = int(batch["response_mask"].sum())
    for k in want:
        if k.endswith("_frac"):  # a fraction of `tokens` indicators: one within rounding of the clip may flip
            assert abs(got[k] - want[k]) <= 2 / tokens + 1e-6, k
        else:
            assert got[k] == pytest.approx(want[k], rel=max(1e-5, tol), abs=tol), k
    for n in want_grads:
        torch.testing.assert_close(grads[n], want_grads[n], atol=tol, rtol=max(1e-4, tol), msg=n)
    torch.testing.assert_close(compiled.infer(batch)["logprobs"], eager.infer(batch)["logprobs"], atol=10 * tol,
                               rtol=1e-5)


def test_the_layer_stack_is_found_in_llama_and_gpt2(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.conftest import build_gpt2

    assert layer_stack(AutoModelForCausalLM.from_pretrained(tiny_model)) is not None
    gpt2 = AutoModelForCausalLM.from_pretrained(build_gpt2(tmp_path / "gpt2"))
    assert layer_stack(gpt2) is gpt2.transformer.h
    assert layer_stack(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


def test_compile_refuses_what_it_cannot_serve():
    from xrlhf.engines.deepspeed import DeepSpeedInferOptions, DeepSpeedTrainOptions

    with pytest.raises(ValueError, match="train.compile: .*gradient_checkpointing"):
        HFTrainOptions.model_validate({"compile": True, "gradient_checkpointing": True})
    with pytest.raises(ValueError, match="compile: ZeRO-3.*use zero_stage 2 or compile: false"):
        DeepSpeedTrainOptions.model_validate({"compile": True, "zero_stage": 3})
    with pytest.raises(ValueError, match="use zero_stage 0 or compile: false"):
        DeepSpeedInferOptions.model_validate({"compile": True, "zero_stage": 3})
    assert DeepSpeedTrainOptions.model_validate({"compile": True, "zero_stage": 2}).compile


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
@pytest.mark.slow  # torch.compile from an empty cache: up to a minute on the 2-core box
def test_the_compile_cache_goes_under_the_runs_cache_directory(tiny_model, tmp_path, monkeypatch):
    """``EngineSpec.cache_dir``: inductor's caches under ``<cache_dir>/torchinductor``, not /tmp."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()  # a fresh worker's state: the tests before compiled the same layers in this process
    compiled = HFTrainEngine(EngineSpec(tiny_model, seed=0, cache_dir=str(tmp_path / "cache"), options={
        "micro_batch_size": 5, "lr": 1e-3, "compile": True, "max_tokens_per_micro_batch": 30}))
    cache = tmp_path / "cache" / "torchinductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    assert f"cache {cache}" in compiled.hf.prepare()
    compiled.train_step(rl_batch(12, seed=1), PolicyLoss(kl_coef=0.05))
    assert any(p.is_file() for p in cache.rglob("*"))  # the compiled graphs were written there


def test_compile_defaults_to_on_for_a_gpus_full_weight_engines():
    from xrlhf.engines.deepspeed import DeepSpeedTrainOptions
    from xrlhf.engines.hf import HFInferOptions

    train = HFTrainOptions(micro_batch_size=4)
    assert train.compile is None and train.compiles("cuda") and train.compiles("cuda:0")
    assert not train.compiles("cpu")  # CPU: compiling costs more than the fused kernels save
    assert HFInferOptions().compiles("cuda") and not HFInferOptions().compiles("cpu")
    assert not HFTrainOptions(micro_batch_size=4, gradient_checkpointing=True).compiles("cuda")
    assert not HFTrainOptions(micro_batch_size=4, lora={"rank": 4}).compiles("cuda")  # not measured on a GPU yet
    assert not DeepSpeedTrainOptions(micro_batch_size=4).compiles("cuda")
    assert HFTrainOptions(micro_batch_size=4, compile=True).compiles("cpu")  # what is set wins
    assert not HFTrainOptions(micro_batch_size=4, compile=False).compiles("cuda")


@pytest.mark.slow  # torch.compile: tens of seconds
def test_a_compiled_critic_gives_the_eager_step_and_values(tiny_model):
    """The value head (PPO's critic, a GPU default since compile turned on there) compiled: the
    same step, gradients and values as eager."""
    from tests.engines.test_packing import ValueLoss
    from xrlhf.engines.hf import HFInferEngine

    batch = rl_batch(12, seed=1)

    def critic(compile: bool):
        return HFTrainEngine(EngineSpec(tiny_model, head="value", seed=0, options={
            "micro_batch_size": 5, "lr": 1e-3, "max_tokens_per_micro_batch": 30, "compile": compile}))

    want, want_grads = grads_of_step(critic(False), batch, ValueLoss())
    got, grads = grads_of_step(critic(True), batch, ValueLoss())
    for k in want:
        if k.endswith("_frac"):
            assert abs(got[k] - want[k]) <= 2 / int(batch["response_mask"].sum()) + 1e-6, k
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    for n in want_grads:
        torch.testing.assert_close(grads[n], want_grads[n], atol=1e-6, rtol=1e-4, msg=n)
    values = [HFInferEngine(EngineSpec(tiny_model, head="value", options={"micro_batch_size": 4, "compile": c}))
              .infer(batch)["values"] for c in (False, True)]
    torch.testing.assert_close(values[1], values[0], atol=1e-5, rtol=1e-5)
