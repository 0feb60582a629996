"""LoRA on the DeepSpeed train engine on CPU: ZeRO-2 makes the Transformers engine's update, ZeRO-3
over two ranks gathers the merged weights (and the adapters alone) bucket by bucket, computes the
reference with the adapters off, saves, and resumes exactly from checkpoints without the base."""

import io
import os
import socket

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")
pytest.importorskip("peft")

from xrlhf.algorithms.losses import SFTLoss  # noqa: E402
from xrlhf.engines.base import EngineSpec, build_engine  # noqa: E402
from xrlhf.models.tiny import build_model  # noqa: E402
from tests.engines.test_deepspeed import OPTS, TOTAL_STEPS, make_batch, max_diff  # noqa: E402

LORA = {"rank": 4, "alpha": 8.0, "sync": "adapter"}  # weights_for_sync: the adapters; named_weights: merged


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("tiny") / "model", seed=1))


def lora_engine(name, model_dir, dist=None, **opts):
    spec = EngineSpec(model_path=model_dir, options={**OPTS, "lora": LORA, **opts}, seed=0, total_steps=TOTAL_STEPS)
    if dist is not None:
        spec.dist = dist
    return build_engine(name, spec, "train")


def adapters(engine):
    return {k: v.detach().clone() for k, v in engine.weights_for_sync()}


@pytest.fixture(scope="module")
def hf_lora_step(model_dir):
    engine = lora_engine("hf", model_dir)
    metrics = engine.train_step(make_batch(), SFTLoss())
    return metrics, {k: v.clone() for k, v in engine.named_weights()}


def test_zero2_lora_makes_the_hf_engines_update(model_dir, one_rank, hf_lora_step):
    hf_metrics, hf_weights = hf_lora_step
    engine = lora_engine("deepspeed", model_dir, zero_stage=2)
    # 2 layers x rank 4 x (4 x (64 + 64) for q, k, v, o + 3 x (64 + 256) for gate, up, down)
    assert sum(p.numel() for p in engine.zero.module.parameters() if p.requires_grad) == 11776
    metrics = engine.train_step(make_batch(), SFTLoss())
    assert abs(metrics["loss"] - hf_metrics["loss"]) < 1e-5
    assert abs(metrics["grad_norm"] - hf_metrics["grad_norm"]) < 1e-4 * hf_metrics["grad_norm"]
    assert max_diff(dict(engine.named_weights()), hf_weights) < 1e-6


def test_zero2_lora_resumes_exactly_from_a_state_without_the_base(model_dir, one_rank):
    a = lora_engine("deepspeed", model_dir, zero_stage=2)
    a.train_step(make_batch(), SFTLoss())
    state = a.state_dict()
    model_files = [n for n in state["shard_files"] if "model_states" in n]
    module = torch.load(io.BytesIO(state["shard_files"][model_files[0]]), weights_only=False)["module"]
    # the adapters, and the tied lm_head (DeepSpeed leaves out frozen parameters by their name in
    # named_parameters, where a tied weight appears once, as the embedding)
    assert sorted(k for k in module if ".lora_" not in k) == ["base_model.model.lm_head.weight"]
    assert len(module) == 1 + 28
    b = lora_engine("deepspeed", model_dir, zero_stage=2)
    b.load_state_dict(state)
    nxt = make_batch(seed=5)
    ma, mb = a.train_step(nxt, SFTLoss()), b.train_step(nxt, SFTLoss())
    assert ma["loss"] == mb["loss"]
    assert max_diff(adapters(a), adapters(b)) == 0.0


# -- two ranks ------------------------------------------------------------------------------
def _rank(rank, port, model_dir, out_dir):
    import torch.distributed as dist

    from xrlhf.engines.base import DistInfo
    from xrlhf.engines.training import merge_rank_states

    torch.set_num_threads(1)
    info = DistInfo(rank, 2, "127.0.0.1", port, "gloo")
    half = make_batch().split(2)[rank]
    opts = dict(zero_stage=3, gather_bucket_mb=64 / 1024,
                deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    z3 = lora_engine("deepspeed", model_dir, info, **opts)
    out = {"base_before": z3.infer_base(make_batch(6, seed=2))["logprobs"]}
    out["metrics"] = z3.train_step(half, SFTLoss())
    out["merged"] = {k: v.clone() for k, v in z3.named_weights()}
    out["merged_stats"] = dict(z3.zero.gather_stats)
    out["adapters"] = adapters(z3)
    out["adapter_stats"] = dict(z3.zero.gather_stats)
    out["base_after"] = z3.infer_base(make_batch(6, seed=2))["logprobs"]
    z3.save_pretrained(os.path.join(out_dir, "merged"))
    states = [None, None]
    dist.all_gather_object(states, z3.state_dict())
    again = lora_engine("deepspeed", model_dir, info, **opts)
    again.load_state_dict(merge_rank_states(states))
    nxt = make_batch(seed=5).split(2)[rank]
    z3.train_step(nxt, SFTLoss())
    again.train_step(nxt, SFTLoss())
    out["resume_diff"] = max_diff(adapters(z3), adapters(again))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("lora-two-ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, model_dir, str(out_dir)), nprocs=2, join=True)
    return out_dir, [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow  # two DeepSpeed ranks start as processes
def test_zero3_lora_gathers_merged_weights_and_adapters(two_ranks, hf_lora_step, model_dir):
    from xrlhf.engines.hf import HFInferEngine

    out_dir, ranks = two_ranks
    r0 = ranks[0]
    assert max_diff(r0["merged"], ranks[1]["merged"]) == 0.0
    assert max_diff(r0["merged"], hf_lora_step[1]) < 5e-6  # the one-rank update, gathered and merged
    assert abs(r0["metrics"]["grad_norm"] - hf_lora_step[0]["grad_norm"]) < 1e-5
    assert len(r0["adapters"]) == 28 and all(".lora_A." in k or ".lora_B." in k for k in r0["adapters"])
    assert r0["adapter_stats"]["peak_gathered_bytes"] < r0["merged_stats"]["peak_gathered_bytes"]
    base = HFInferEngine(EngineSpec(model_dir)).infer(make_batch(6, seed=2))["logprobs"]
    assert torch.allclose(r0["base_before"], base, atol=1e-6) and torch.equal(r0["base_before"], r0["base_after"])
    saved = HFInferEngine(EngineSpec(str(out_dir / "merged"))).hf.model.state_dict()
    assert max_diff({k: saved[k] for k in r0["merged"]}, r0["merged"]) == 0.0
    assert ranks[0]["resume_diff"] == 0.0 and ranks[1]["resume_diff"] == 0.0
