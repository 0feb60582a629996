"""DeepSpeed on two GPUs: ZeRO-3 bf16 policy training across both, bucketed gathering, saving,
optimizer + parameter offload, and PPO with vLLM in both layouts (``configs/gpu/ppo_deepspeed_*.yaml``).

Run on a machine with two GPUs: ``pytest -m gpu tests/gpu/test_deepspeed_gpu.py``
(or ``bash benchmarks/gpu.sh tests2``).
"""

import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
deepspeed = pytest.importorskip("deepspeed")

BUCKET_MB = 1  # the 4M-parameter model (8 MiB in bf16) gathers in about 10 buckets


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(rank, rows=8):
    from xrlhf.data.batch import build_sequences

    g = torch.Generator().manual_seed(rank)
    return build_sequences(torch.randint(4, 100, (rows, 24), generator=g).tolist(),
                           torch.randint(4, 100, (rows, 16), generator=g).tolist(), pad_id=0)


def _rank(rank, port, model_dir, out_dir, options):
    from xrlhf.algorithms.losses import SFTLoss
    from xrlhf.engines.base import DistInfo, EngineSpec
    from xrlhf.engines.deepspeed import DeepSpeedTrainEngine

    spec = EngineSpec(model_path=model_dir, device=f"cuda:{rank}",
                      options={"lr": 1e-3, "micro_batch_size": 4, "dtype": "bfloat16", "gather_bucket_mb": BUCKET_MB,
                               "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
                               **options}, dist=DistInfo(rank, 2, "127.0.0.1", port, "nccl"), seed=0)
    engine = DeepSpeedTrainEngine(spec)
    torch.cuda.reset_peak_memory_stats()
    batch = _batch(rank)
    losses = [engine.train_step(batch, SFTLoss())["loss"] for _ in range(4)]
    weights = {k: v.float().cpu() for k, v in engine.named_weights()}
    out = {"losses": losses, "stats": dict(engine.zero.gather_stats), "device": str(engine.zero.hf.device),
           "param_dtype": str(next(engine.zero.module.parameters()).dtype),
           "local_numel": sum(p.ds_tensor.numel() for p in engine.zero.module.parameters()),
           "checksum": sum(float(v.double().sum()) for v in weights.values())}
    engine.save_pretrained(os.path.join(out_dir, "hf"))
    if rank == 0:
        torch.save(weights, os.path.join(out_dir, "weights.pt"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from xrlhf.models.tiny import PRESETS, build_model

    return str(build_model(tmp_path_factory.mktemp("small") / "model", **PRESETS["small"], dtype="bfloat16"))


def run_two(model_dir, out_dir, **options):
    torch.multiprocessing.spawn(_rank, args=(_port(), model_dir, str(out_dir), options), nprocs=2)
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]


def check(out_dir, ranks):
    from transformers import AutoModelForCausalLM

    for r in ranks:
        assert r["losses"][-1] < r["losses"][0] - 0.05, r["losses"]  # learns the fixed batch
        assert r["param_dtype"] == "torch.bfloat16"
    assert ranks[0]["device"] == "cuda:0" and ranks[1]["device"] == "cuda:1"
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # both ranks gathered the same weights
    weights = torch.load(Path(out_dir, "weights.pt"))
    total = sum(v.numel() * 2 for k, v in weights.items() if k != "lm_head.weight")
    assert ranks[0]["local_numel"] * 2 <= total / 2 + (1 << 20)  # ZeRO-3: each GPU holds about half
    assert ranks[0]["stats"]["peak_gathered_bytes"] <= BUCKET_MB << 20 < total
    saved = AutoModelForCausalLM.from_pretrained(Path(out_dir, "hf"), dtype=torch.bfloat16).state_dict()
    for k, v in weights.items():
        assert torch.equal(saved[k].float(), v), k


def test_zero3_bf16_across_two_gpus(model_dir, tmp_path):
    check(tmp_path, run_two(model_dir, tmp_path, zero_stage=3))


def test_zero3_offload_across_two_gpus(model_dir, tmp_path):
    check(tmp_path, run_two(model_dir, tmp_path, zero_stage=3, offload_optimizer=True, offload_params=True))


def test_ppo_zero3_policy_with_colocated_vllm(model_05b, tmp_path):
    """PPO 3 steps (configs/gpu/ppo_deepspeed_zero3.yaml): the policy on ZeRO-3 across both GPUs,
    a vLLM per rank on its GPU, weights gathered bucket by bucket and checked by checksums."""
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    from tests.gpu.test_ppo_vllm import run_config

    steps = run_config("ppo_deepspeed_zero3", model_05b, tmp_path)
    assert all(r["time/sleep_s"] > 0 for r in steps)  # vLLM slept for every update
    assert (tmp_path / "final" / "config.json").is_file()  # saved from ZeRO-3 shards


def test_ppo_deepspeed_split_nccl(model_05b, tmp_path):
    """PPO 3 steps (configs/gpu/ppo_deepspeed_split.yaml): DeepSpeed on GPU 0, vLLM on GPU 1, NCCL."""
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    from tests.gpu.test_ppo_vllm import run_config

    run_config("ppo_deepspeed_split", model_05b, tmp_path)
