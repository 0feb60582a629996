"""Mixed precision (issue 16): ``dtype: bfloat16`` with ``mixed_precision: true`` keeps fp32 master
weights and AdamW states and runs the forward under bf16 autocast; ``false`` is pure bf16, where
updates below bf16's precision round away. CPU runs bf16 autocast too, so both are real here."""

from __future__ import annotations

import pytest
import torch

from xrlhf.algorithms.losses import SFTLoss
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFTrainEngine
from xrlhf.utils.errors import UserError
from xrlhf.validation import validate_dict


def batch(model: str):
    tok = load_tokenizer(model)
    prompts = [encode_prompt(tok, f"{i}+{i}=") for i in range(8)]
    targets = [tok.encode(str(2 * i), add_special_tokens=False) + [tok.eos_token_id] for i in range(8)]
    return build_sequences(prompts, targets, tok.pad_token_id)


def engine(model: str, lr: float, **options) -> HFTrainEngine:
    return HFTrainEngine(EngineSpec(model, options={"lr": lr, "micro_batch_size": 8, **options}, seed=0))


def changed(before: dict, e: HFTrainEngine) -> float:
    """The fraction of weight entries a step moved (compared in fp32)."""
    after = dict(e.named_weights())
    moved = sum(int((after[k].float() != before[k].float()).sum()) for k in before)
    return moved / sum(v.numel() for v in before.values())


def test_mixed_precision_keeps_fp32_masters_and_small_updates(tiny_model):
    b = batch(tiny_model)
    fp32, mixed = engine(tiny_model, 1e-6), engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True)
    pure = engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=False)
    assert mixed.mixed_precision and not pure.mixed_precision
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in pure.model.parameters())
    before = {name: {k: v.clone() for k, v in e.named_weights()} for name, e in
              (("fp32", fp32), ("mixed", mixed), ("pure", pure))}
    losses = {name: e.train_step(b, SFTLoss())["loss"] for name, e in (("fp32", fp32), ("mixed", mixed),
                                                                        ("pure", pure))}
    # the forward ran in bf16: close to fp32's loss, not equal to it
    assert losses["mixed"] == pytest.approx(losses["fp32"], rel=2e-2) and losses["mixed"] != losses["fp32"]
    # Adam's first step moves every weight by lr = 1e-6: fp32 masters keep it, bf16 weights
    # (spacing ~1e-4 at this model's scale) round almost all of it away
    assert changed(before["mixed"], mixed) > 0.95
    assert changed(before["pure"], pure) < 0.05
    state = next(iter(mixed.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


def test_mixed_precision_defaults_and_validation(tiny_model, base_config):
    # default on CPU: off (pure bf16, as before); fp32 never autocasts
    assert not engine(tiny_model, 1e-3, dtype="bfloat16").mixed_precision
    assert not engine(tiny_model, 1e-3, mixed_precision=True).mixed_precision
    base_config["policy"]["train"].update(engine="deepspeed", dtype="bfloat16", mixed_precision=False)
    with pytest.raises(UserError, match=r"policy.train.mixed_precision: DeepSpeed's bf16 mode always keeps fp32"):
        validate_dict(base_config)


def test_mixed_precision_with_lora_keeps_the_frozen_base_in_bf16(tiny_model):
    """Only what trains needs fp32 masters: PEFT's adapters are fp32, the frozen base stays bf16."""
    pytest.importorskip("peft")
    e = engine(tiny_model, 1e-3, dtype="bfloat16", mixed_precision=True, lora={"rank": 4})
    frozen = [p for p in e.model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert e.params and all(p.dtype == torch.float32 for p in e.params)
    assert torch.isfinite(torch.tensor(e.train_step(batch(tiny_model), SFTLoss())["loss"]))


def test_mixed_precision_packs(tiny_model):
    """fp32 weights under bf16 autocast compute in bf16: the packing probe compares packed and
    padded at bf16's tolerance, so the engine packs (on an H100 it fell back to padded rows,
    judged at fp32's tolerance)."""
    from xrlhf.engines.hf.probe import _tolerance, compute_dtype

    e = engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True)
    assert e.mixed_precision and next(e.hf.module.parameters()).dtype == torch.float32
    assert compute_dtype(e.hf) == torch.bfloat16 and _tolerance(e.hf) == 5e-2
    assert e.hf.attention_path == "varlen"
    assert e.train_step(batch(tiny_model), SFTLoss())["packed"] == 1.0
