"""vLLM with tensor parallelism (``tensor_parallel_size: 2``, vLLM's own worker processes on GPUs 0
and 1): every transport that can serve it leaves each rank with the trainer's weights (read-back
on every rank, verify on) and generating accordingly, after sleep level 2 (weights dropped) and
again on a second sync; a LoRA adapter reaches both ranks; CUDA IPC, which needs the trainer on
each rank's own GPU, is refused by name.

A co-located trainer rank per vLLM rank (CUDA IPC per rank) needs the generator's ranks inside
the trainer's placement, which the co-located layout does not do yet (tensor parallelism needs the
split layout: ``VLLMGenerateEngine.placement_errors``).

Run on a machine of 2 GPUs or more (the NCCL case: 3): ``pytest -m gpu tests/gpu/test_vllm_tp.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.gpu_helpers import free_port, generate_options
from tests.gpu.test_lora_gpu import LORA, check_sampling, lora_trainer
from tests.gpu.test_vllm_engine import check_sync, perturbed, trainer
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.envs import build_env
from xrlhf.weight_sync import build_transport, checksum, compare_checksums, push_weights

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]
pytest.importorskip("vllm")

TP = 2


def tp_options(**fields) -> dict:
    return generate_options(gpu_memory_utilization=0.25, max_model_len=256, max_num_seqs=64,
                            tensor_parallel_size=TP, multiprocessing=True, **fields)


@pytest.fixture(scope="module")
def tp_engine(small_model):
    from xrlhf.engines.vllm import VLLMGenerateEngine

    engine = VLLMGenerateEngine(EngineSpec(small_model, device="cuda", seed=0,
                                           options={**tp_options(sleep_level=2), "dtype": "float32"}))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(small_model):
    tok = load_tokenizer(small_model)
    return [encode_prompt(tok, p.text) for p in build_env("reasoning", {"eval_size": 48}, 0).eval_prompts()]


@pytest.mark.parametrize("name", ["cpu", "disk"])
def test_host_transports_reach_every_tensor_parallel_rank(tp_engine, small_model, prompts, name):
    t = perturbed(trainer(small_model, "cuda:0"), seed=20 + len(name))
    transport = build_transport(name, bucket_bytes=4 << 20, verify=True)
    check_sync(tp_engine, small_model, prompts, t, transport)
    check_sync(tp_engine, small_model, prompts, perturbed(t, seed=30), transport)  # a second sync


@pytest.mark.gpus(3)
def test_nccl_broadcasts_to_every_tensor_parallel_rank(tp_engine, small_model, prompts):
    """The trainer on the third GPU is rank 0 of a group of 1 + TP ranks (NCCL puts no two on a GPU)."""
    t = perturbed(trainer(small_model, "cuda:2"), seed=41)
    transport = build_transport("nccl", bucket_bytes=4 << 20, verify=True, host="127.0.0.1", port=free_port(),
                                world_size=1 + TP, rank=0, timeout_s=120)
    check_sync(tp_engine, small_model, prompts, t, transport)
    check_sync(tp_engine, small_model, prompts, perturbed(t, seed=42), transport)  # the group is reused


def test_cuda_ipc_is_refused_where_a_rank_is_on_another_gpu(tp_engine, small_model):
    t = trainer(small_model, "cuda:0")  # rank 1 of vLLM is on GPU 1
    with pytest.raises(Exception, match="CUDA IPC needs both on one GPU"):
        push_weights(build_transport("cuda_ipc"), t.named_weights(), tp_engine.receive_weights)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from xrlhf.models.tiny import PRESETS, build_model

    return str(build_model(tmp_path_factory.mktemp("models") / "small-bf16", **PRESETS["small"], dtype="bfloat16",
                           seed=0))


def test_a_lora_adapter_reaches_every_tensor_parallel_rank(bf16_model, prompts):
    from xrlhf.engines.lora import LoraOptions
    from xrlhf.engines.vllm import VLLMGenerateEngine

    t = lora_trainer(bf16_model, "adapter")
    engine = VLLMGenerateEngine(EngineSpec(bf16_model, device="cuda", seed=0,
                                           options=tp_options(sleep_level=1, dtype="bfloat16"),
                                           adapter=LoraOptions(**LORA, sync="adapter")))
    try:
        for rnd in range(2):  # the second sync replaces the adapter in place
            if rnd:
                with torch.no_grad():
                    for p in t.params:
                        p.mul_(-1.0)
            engine.sleep()
            tr = build_transport("cpu", bucket_bytes=4 << 20, verify=True, dtype=torch.bfloat16)
            n = push_weights(tr, t.weights_for_sync(), engine.receive_weights)
            engine.end_sync(rnd + 1)
            sent = {k: checksum(v.to(torch.bfloat16)) for k, v in t.weights_for_sync()}
            assert n == len(sent)
            compare_checksums(sent, engine.weight_checksums(), "vLLM")
            diff = check_sampling(engine, t, bf16_model, prompts)
            assert diff["mean"] < 0.05 and diff["base_mean"] > 5 * diff["mean"], diff
    finally:
        engine.shutdown()
