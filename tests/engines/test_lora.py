"""LoRA on the Transformers train engine (``xrlhf.engines.lora``): the wrapped model starts as
its base, only the adapters train, the base is the reference, the weights leave merged or as
adapters (checksummed), checkpoints hold the trainable tensors and resume exactly, and the saved
model loads in Transformers / PEFT."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")

from xrlhf.algorithms.losses import SFTLoss  # noqa: E402
from xrlhf.data.batch import build_sequences  # noqa: E402
from xrlhf.data.text import encode_prompt, load_tokenizer  # noqa: E402
from xrlhf.engines.base import EngineSpec, SamplingParams  # noqa: E402
from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine, HFTrainEngine  # noqa: E402
from xrlhf.engines.lora import LoraOptions, adapter_params, is_adapter  # noqa: E402
from xrlhf.weight_sync import build_transport, checksum, compare_checksums, push_weights  # noqa: E402

LORA = {"rank": 4, "alpha": 8.0}
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


def sft_batch(tok, n=8, offset=0):
    prompts = [encode_prompt(tok, f"{i + offset}+{i}=") for i in range(n)]
    targets = [tok.encode(str(2 * i + offset), add_special_tokens=False) + [tok.eos_token_id] for i in range(n)]
    return build_sequences(prompts, targets, tok.pad_token_id)


def lora_engine(model, lora=None, **options):
    return HFTrainEngine(EngineSpec(model, options={"lr": 1e-2, "micro_batch_size": 4, "lora": lora or LORA,
                                                    **options}, seed=0))


def base_state(model):
    return {k: v.clone() for k, v in HFInferEngine(EngineSpec(model)).hf.model.state_dict().items()}


def test_the_wrapped_model_computes_its_base(tiny_model, tok):
    batch = sft_batch(tok)
    # the same micro-batches as the LoRA engine's: packed rows of another composition differ in the last bit
    plain = HFInferEngine(EngineSpec(tiny_model, options={"micro_batch_size": 4})).infer(batch)["logprobs"]
    t = lora_engine(tiny_model)
    assert torch.equal(t.infer(batch)["logprobs"], plain)  # B starts at 0
    assert torch.equal(t.infer_base(batch)["logprobs"], plain)
    assert sorted({n.split(".")[-1] for n in t.lora.layers}) == TARGETS  # all-linear: every layer but lm_head
    assert not any("lm_head" in n for n in t.lora.layers)


def test_only_the_adapters_train_and_the_base_stays_the_reference(tiny_model, tok):
    batch = sft_batch(tok)
    t = lora_engine(tiny_model)
    n_adapter = sum(p.numel() for p in t.params)
    assert n_adapter == adapter_params(tiny_model, "causal_lm", LoraOptions(**LORA))
    assert all(is_adapter(n) for n in t.lora.trainable) and len(t.lora.trainable) == 2 * 7 * 2  # A, B x 7 x 2 layers
    before = base_state(tiny_model)
    first = t.train_step(batch, SFTLoss())["loss"]
    for _ in range(4):
        last = t.train_step(batch, SFTLoss())["loss"]
    assert last < first
    # the optimizer holds the adapters' states only
    states = [s for s in t.optimizer.state.values()]
    assert sum(s["exp_avg"].numel() for s in states) == n_adapter
    # base tensors untouched, in the PEFT model
    peft_state = t.model.state_dict()
    for name, value in before.items():
        key = next(k for k in peft_state if k.removeprefix("base_model.model.").replace(".base_layer.", ".") == name)
        assert torch.equal(peft_state[key], value), name
    plain = HFInferEngine(EngineSpec(tiny_model, options={"micro_batch_size": 4})).infer(batch)["logprobs"]
    assert torch.equal(t.infer_base(batch)["logprobs"], plain)  # the reference: the start model, bit for bit
    assert not torch.equal(t.infer(batch)["logprobs"], plain)


def test_merged_weights_have_the_base_names_and_compute_the_adapted_model(tiny_model, tok):
    batch = sft_batch(tok)
    t = lora_engine(tiny_model)
    for _ in range(3):
        t.train_step(batch, SFTLoss())
    merged = dict(t.named_weights())
    base = base_state(tiny_model)
    assert list(merged) == list(base)  # the base model's names, in its order
    changed = {n for n in merged if not torch.equal(merged[n], base[n])}
    assert changed == {f"{layer}.weight" for layer in t.lora.layers}
    # PEFT's own merge of a copy agrees (it computes in the weights' dtype, we in float32: fp32 here)
    reference = copy.deepcopy(t.model).merge_and_unload().state_dict()
    for n in changed:
        torch.testing.assert_close(merged[n], reference[n], atol=1e-6, rtol=0)
    # an ordinary model loaded with the merged weights computes what the adapters do
    infer = HFInferEngine(EngineSpec(tiny_model))
    infer.hf.model.load_state_dict(merged)
    torch.testing.assert_close(infer.infer(batch)["logprobs"], t.infer(batch)["logprobs"], atol=2e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(t.lora.model.state_dict().values(),
                                                  copy.deepcopy(t.model).state_dict().values()))  # not mutated


@pytest.mark.parametrize("transport", ["in_process", "cpu"])
def test_a_merged_sync_reaches_the_hf_generator_verified(tiny_model, tok, transport):
    t = lora_engine(tiny_model)
    batch = sft_batch(tok)
    for _ in range(3):
        t.train_step(batch, SFTLoss())
    gen = HFGenerateEngine(EngineSpec(tiny_model, seed=0))
    n = push_weights(build_transport(transport, verify=True, bucket_bytes=16 << 10), t.weights_for_sync(),
                     gen.receive_weights)
    gen.end_sync(1)
    sent = {k: checksum(v) for k, v in t.weights_for_sync()}
    assert n == len(sent)
    compare_checksums(sent, gen.weight_checksums())
    prompts = [encode_prompt(tok, f"{i}+{i}=") for i in range(6)]
    out = gen.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, seed=3))
    rollout = build_sequences(prompts, out.token_ids, tok.pad_token_id, out.logprobs)
    mask = rollout["response_mask"].bool()
    diff = (t.infer(rollout)["logprobs"] - rollout["rollout_logprobs"])[mask].abs().max()
    assert diff < 1e-4, float(diff)  # the generator samples from the adapted policy


def test_an_adapter_sync_sends_the_adapter_tensors_only(tiny_model, tok):
    t = lora_engine(tiny_model, {**LORA, "sync": "adapter"})
    t.train_step(sft_batch(tok), SFTLoss())
    sent = dict(t.weights_for_sync())
    assert len(sent) == 28 and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in sent)
    assert all(n.startswith("base_model.model.model.layers.") for n in sent)  # PEFT's adapter file names
    params = dict(t.model.named_parameters())
    for n, v in sent.items():
        assert torch.equal(v, params[n.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")])
    assert len(dict(t.named_weights())) == len(base_state(tiny_model))  # full weights (save, checksums) stay merged


def test_checkpoint_holds_the_trainable_tensors_and_resumes_exactly(tiny_model, tok):
    a = lora_engine(tiny_model)
    a.train_step(sft_batch(tok), SFTLoss())
    state = copy.deepcopy(a.state_dict())  # as written to disk: the optimizer's state_dict holds its live tensors
    assert sorted(state["model"]) == sorted(a.lora.trainable)
    b = lora_engine(tiny_model)
    b.load_state_dict(state)
    nxt = sft_batch(tok, offset=3)
    ma, mb = a.train_step(nxt, SFTLoss()), b.train_step(nxt, SFTLoss())
    assert ma["loss"] == mb["loss"]
    for (na, va), (nb, vb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert na == nb and torch.equal(va, vb), na
    with pytest.raises(ValueError, match="does not match the model's adapters"):
        lora_engine(tiny_model, {**LORA, "target_modules": ["q_proj"]}).load_state_dict(state)


def test_save_pretrained_merged_loads_in_transformers_and_adapter_in_peft(tiny_model, tok, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = sft_batch(tok)
    t = lora_engine(tiny_model)
    for _ in range(3):
        t.train_step(batch, SFTLoss())
    want = t.infer(batch)["logprobs"]
    t.save_pretrained(str(tmp_path / "merged"))
    merged = HFInferEngine(EngineSpec(str(tmp_path / "merged"))).infer(batch)["logprobs"]
    torch.testing.assert_close(merged, want, atol=2e-5, rtol=0)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    t.lora.options = t.lora.options.model_copy(update={"save": "adapter"})
    t.save_pretrained(str(tmp_path / "adapter"))
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files and "config.json" not in files
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(tmp_path / "adapter"))
    infer = HFInferEngine(EngineSpec(tiny_model))
    infer.hf.model, infer.hf.module = peft_model.eval(), peft_model.get_base_model()
    infer.hf.prepare()  # a model put in after the engine was built: probe its packing and logprob head again
    torch.testing.assert_close(infer.infer(batch)["logprobs"], want, atol=2e-5, rtol=0)


def test_gradient_checkpointing_and_dropout_with_lora(tiny_model, tok):
    batch = sft_batch(tok)
    t = lora_engine(tiny_model, gradient_checkpointing=True)
    plain = lora_engine(tiny_model)
    ma, mb = t.train_step(batch, SFTLoss()), plain.train_step(batch, SFTLoss())
    assert ma["grad_norm"] > 0 and abs(ma["grad_norm"] - mb["grad_norm"]) < 1e-5 * mb["grad_norm"]
    dropped = lora_engine(tiny_model, {**LORA, "dropout": 0.5}, dropout=True)
    assert any(m.p == 0.5 for m in dropped.model.modules() if isinstance(m, torch.nn.Dropout))


def test_a_critic_with_lora_trains_its_new_head_in_full(tiny_model, tok):
    batch = sft_batch(tok)
    batch["returns"] = torch.ones_like(batch["response_mask"], dtype=torch.float32)
    batch["old_values"] = torch.zeros_like(batch["returns"])
    from xrlhf.algorithms.losses import ValueLoss

    t = HFTrainEngine(EngineSpec(tiny_model, head="value", options={"lr": 1e-2, "lora": LORA}, seed=0))
    assert any("score.modules_to_save" in n for n in t.lora.trainable)
    head = next(v.clone() for k, v in t.model.state_dict().items() if "score.modules_to_save" in k)
    t.train_step(batch, ValueLoss(clip_eps=0.2))
    assert not torch.equal(head, next(v for k, v in t.model.state_dict().items() if "score.modules_to_save" in k))
    names = list(dict(t.named_weights()))
    assert "score.weight" in names and not any("modules_to_save" in n or "original_module" in n for n in names)


def test_options_reject_unknown_keys_and_dropout_without_dropout():
    from pydantic import ValidationError

    from xrlhf.engines.hf.train import HFTrainOptions

    with pytest.raises(ValidationError, match="extra"):
        HFTrainOptions(lora={"rank": 4, "ranks": 8})
    with pytest.raises(ValidationError, match=r"train.lora.dropout: 0.1 needs train.dropout: true"):
        HFTrainOptions(lora={"dropout": 0.1})
    with pytest.raises(ValidationError, match="name at least one linear layer"):
        HFTrainOptions(lora={"target_modules": []})
    assert HFTrainOptions(lora={}).lora.scaling == 2.0
