"""Mixed precision (issues 16, 25): ``dtype: bfloat16`` with ``mixed_precision: true`` trains bf16
weights with fp32 master weights, fp32 gradient accumulation and fp32 AdamW states in the optimizer
(``engines.mixed_precision.MasterWeights``); ``false`` is pure bf16, where updates below bf16's
precision round away. bf16 runs on the CPU too, so both are real here."""

from __future__ import annotations

import io

import pytest
import torch

from xrlhf.algorithms.losses import SFTLoss
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFTrainEngine
from xrlhf.utils.errors import UserError
from xrlhf.validation import validate_dict


def batch(model: str, n: int = 8):
    tok = load_tokenizer(model)
    prompts = [encode_prompt(tok, f"{i}+{i}=") for i in range(n)]
    targets = [tok.encode(str(2 * i), add_special_tokens=False) + [tok.eos_token_id] for i in range(n)]
    return build_sequences(prompts, targets, tok.pad_token_id)


def engine(model: str, lr: float, **options) -> HFTrainEngine:
    return HFTrainEngine(EngineSpec(model, options={"lr": lr, "micro_batch_size": 8, **options}, seed=0))


def moved(before: dict, after: dict) -> float:
    """The fraction of entries that differ (compared in fp32)."""
    changed = sum(int((after[k].float() != before[k].float()).sum()) for k in before)
    return changed / sum(v.numel() for v in before.values())


def masters(e: HFTrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in e.masters.named_masters(e.param_names).items()}


def test_mixed_precision_trains_bf16_weights_with_fp32_masters(tiny_model):
    b = batch(tiny_model)
    fp32, mixed = engine(tiny_model, 1e-6), engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True)
    pure = engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=False)
    assert mixed.mixed_precision and not pure.mixed_precision and pure.masters is None
    assert all(p.dtype == torch.bfloat16 for p in mixed.model.parameters())  # forward and backward in bf16
    assert all(p.dtype == torch.bfloat16 for p in pure.model.parameters())
    # the masters start from the checkpoint's fp32 values, the weights are their bf16 rounding
    start = masters(mixed)
    for name, w in fp32.model.named_parameters():
        assert torch.equal(start[name], w.detach())
    before = {name: {k: v.clone() for k, v in e.named_weights()} for name, e in (("fp32", fp32), ("pure", pure))}
    losses = {name: e.train_step(b, SFTLoss())["loss"] for name, e in (("fp32", fp32), ("mixed", mixed),
                                                                        ("pure", pure))}
    # the forward ran in bf16: close to fp32's loss, not equal to it, and pure bf16's exactly
    assert losses["mixed"] == pytest.approx(losses["fp32"], rel=2e-2) and losses["mixed"] != losses["fp32"]
    assert losses["mixed"] == losses["pure"]
    # Adam's first step moves every weight by lr = 1e-6: fp32 keeps it, and so do the masters;
    # bf16 weights (spacing ~1e-4 at this model's scale) round almost all of it away
    assert moved(before["fp32"], dict(fp32.named_weights())) > 0.95
    assert moved(start, masters(mixed)) > 0.95
    assert moved(before["pure"], dict(pure.named_weights())) < 0.05
    weights = dict(mixed.model.named_parameters())
    for name, m in masters(mixed).items():
        assert torch.equal(weights[name].detach(), m.to(torch.bfloat16))
    (master,) = mixed.optimizer.param_groups[0]["params"]  # one flat fp32 tensor, Adam's states alike
    state = mixed.optimizer.state[master]
    assert master.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert master.numel() == sum(p.numel() for p in mixed.model.parameters())


def test_small_updates_reach_the_bf16_weights_once_the_masters_moved_far_enough(tiny_model):
    b = batch(tiny_model)
    mixed, pure = (engine(tiny_model, 3e-6, dtype="bfloat16", mixed_precision=m) for m in (True, False))
    start = {name: {k: v.clone() for k, v in e.named_weights()} for name, e in (("mixed", mixed), ("pure", pure))}
    first = {}
    for step in range(30):
        for name, e in (("mixed", mixed), ("pure", pure)):
            e.train_step(b, SFTLoss())
            if step == 0:
                first[name] = moved(start[name], dict(e.named_weights()))
    # each step is below the spacing of most bf16 weights (measured: 10% of them moved after one
    # step, 83% after 30; pure bf16 4%, then no more): 30 steps add up in the masters only
    assert first["mixed"] < 0.2 and first["pure"] < 0.2
    after = {name: moved(start[name], dict(e.named_weights())) for name, e in (("mixed", mixed), ("pure", pure))}
    assert after["mixed"] > 0.5 and after["pure"] < 2 * first["pure"], after


def test_micro_batches_accumulate_in_fp32(tiny_model):
    """The step's gradient is the fp32 sum of each micro-batch's bf16 gradient, in micro-batch
    order (bit for bit: the same forward and backward per micro-batch); a bf16 sum is far off."""
    b = batch(tiny_model, 16)
    loss = SFTLoss()
    per_mb = engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True, micro_batch_size=4)
    denom = b["response_mask"].sum().double()
    parts = []
    for _, mb in per_mb.micro_batches(b):
        loss_sum, _ = loss(per_mb.forward(mb), mb)
        (loss_sum / denom).backward()
        parts.append(per_mb.masters.grad.clone())  # the micro-batch's bf16 gradient, exactly (added to zero)
        per_mb.masters.zero_grad()
    assert len(parts) == 4

    captured = {}

    def capture(e: HFTrainEngine, key: str):
        def step():
            captured[key] = e.masters.grad.clone()
            return {}
        e.optimizer_step = step
        e.train_step(b, loss)

    capture(engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True, micro_batch_size=4), "grad")
    fp32_sum = torch.zeros_like(parts[0])
    for g in parts:
        fp32_sum += g
    assert torch.equal(captured["grad"], fp32_sum)
    exact = torch.stack(parts).double().sum(0)
    bf16_sum = torch.zeros_like(parts[0], dtype=torch.bfloat16)
    for g in parts:
        bf16_sum += g.to(torch.bfloat16)
    fp32_err, bf16_err = ((x.double() - exact).abs().max() for x in (captured["grad"], bf16_sum))
    assert fp32_err <= 1e-6 * exact.abs().max() and bf16_err > 100 * fp32_err

    # and one big micro-batch gives the same gradient within bf16's rounding of its parts
    capture(engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True, micro_batch_size=16), "big")
    assert (captured["big"] - captured["grad"]).norm() < 1e-2 * captured["grad"].norm()


def test_resume_is_bit_exact(tiny_model):
    b = batch(tiny_model)
    a = engine(tiny_model, 1e-4, dtype="bfloat16", mixed_precision=True, lr_warmup_steps=3)
    a.train_step(b, SFTLoss())
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)  # as a checkpoint does (the optimizer's state is live until then)
    saved.seek(0)
    state = torch.load(saved, weights_only=False)
    assert state["masters"]["flat"].dtype == torch.float32
    a.train_step(b, SFTLoss())
    resumed = engine(tiny_model, 1e-4, dtype="bfloat16", mixed_precision=True, lr_warmup_steps=3)
    resumed.load_state_dict(state)
    resumed.train_step(b, SFTLoss())
    for (name, x), (_, y) in zip(a.named_weights(), resumed.named_weights()):
        assert torch.equal(x, y), name
    assert torch.equal(a.masters.flat, resumed.masters.flat)
    with pytest.raises(ValueError, match="mixed precision's fp32 master weights"):
        engine(tiny_model, 1e-4, dtype="bfloat16", mixed_precision=False).load_state_dict(state)


def test_mixed_precision_defaults_and_validation(tiny_model, base_config):
    # default on CPU: off (pure bf16, as before); fp32 never mixes
    assert not engine(tiny_model, 1e-3, dtype="bfloat16").mixed_precision
    assert not engine(tiny_model, 1e-3, mixed_precision=True).mixed_precision
    base_config["policy"]["train"].update(engine="deepspeed", dtype="bfloat16", mixed_precision=False)
    with pytest.raises(UserError, match=r"policy.train.mixed_precision: DeepSpeed's bf16 mode always keeps fp32"):
        validate_dict(base_config)


def test_mixed_precision_with_lora_trains_the_adapters_only(tiny_model):
    """The frozen base stays bf16 and has no masters; the adapters compute in bf16 and their fp32
    masters keep a small step."""
    pytest.importorskip("peft")
    e = engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True, lora={"rank": 4})
    frozen = [p for p in e.model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert e.params and all(p.dtype == torch.bfloat16 for p in e.params)
    assert all(".lora_" in n for n in e.param_names)
    assert e.masters.flat.numel() == sum(p.numel() for p in e.params)
    start = masters(e)
    assert torch.isfinite(torch.tensor(e.train_step(batch(tiny_model), SFTLoss())["loss"]))
    assert moved(start, masters(e)) > 0.45  # lora_B starts at 0 and moves; lora_A moves too (B != 0 after it)


def test_mixed_precision_packs(tiny_model):
    """bf16 weights compute in bf16: the packing probe compares packed and padded at bf16's
    tolerance, and the engine packs."""
    from xrlhf.engines.hf.probe import _tolerance, compute_dtype

    e = engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True)
    assert e.mixed_precision and next(e.hf.module.parameters()).dtype == torch.bfloat16
    assert compute_dtype(e.hf) == torch.bfloat16 and _tolerance(e.hf) == 5e-2
    assert e.hf.attention_path == "varlen"
    assert e.train_step(batch(tiny_model), SFTLoss())["packed"] == 1.0


def _rank(rank: int, port: int, model: str, out_dir: str) -> None:
    """One of two spawned gloo ranks: a mixed-precision step on its half of the batch."""
    import torch.distributed as dist

    from xrlhf.engines.base import DistInfo

    torch.set_num_threads(1)
    e = HFTrainEngine(EngineSpec(model, seed=0, dist=DistInfo(rank, 2, "127.0.0.1", port, "gloo"), options={
        "lr": 1e-6, "micro_batch_size": 4, "dtype": "bfloat16", "mixed_precision": True}))
    metrics = e.train_step(batch(model, 16).split(2)[rank], SFTLoss())
    torch.save({"metrics": metrics, "masters": e.masters.flat.detach().clone()}, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_sum_their_fp32_gradients(tiny_model, tmp_path):
    """Data parallel: the ranks all-reduce the flat fp32 gradient; the step equals one rank's on
    the whole batch within fp32 rounding (the same micro-batches, summed in another order)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, tiny_model, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    one = engine(tiny_model, 1e-6, dtype="bfloat16", mixed_precision=True, micro_batch_size=4)
    metrics = one.train_step(batch(tiny_model, 16), SFTLoss())
    assert torch.equal(ranks[0]["masters"], ranks[1]["masters"])
    assert (ranks[0]["masters"] - one.masters.flat.detach()).abs().max() < 1e-9
    assert ranks[0]["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
