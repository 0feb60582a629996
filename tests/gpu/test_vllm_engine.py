"""vLLM against the Transformers engine on a GPU: same greedy tokens, the logprob contract,
and each weight-sync transport leaving vLLM with exactly the trainer's weights (checksum
read-back, verify on) and generating accordingly.

One vLLM engine serves the module (float32 small model, sleep level 2, built first so that it
profiles an idle GPU, its engine core in a process of its own: a process cannot map its own CUDA IPC
handles, and the trainer is this test's process); the trainer sits on the same GPU (cpu, cuda_ipc,
disk) or on the second (nccl). Run on a GPU machine: ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.gpu_helpers import free_port, generate_options
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.envs import build_env
from xrlhf.weight_sync import build_transport, checksum, compare_checksums, push_weights

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")

GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
# The Transformers engines here are references, so eager: compiled layers (the GPU default) are
# checked against eager in test_numerics_guard.py, and each engine built here would compile anew.
HF = {"dtype": "float32", "compile": False}


@pytest.fixture(scope="module")
def vllm_engine(small_model):
    from xrlhf.engines.vllm import VLLMGenerateEngine

    options = generate_options(gpu_memory_utilization=0.25, sleep_level=2, max_model_len=256, max_num_seqs=64,
                               multiprocessing=True)
    engine = VLLMGenerateEngine(EngineSpec(small_model, device="cuda", seed=0, options={**options, "dtype": "float32"}))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(small_model):
    tok = load_tokenizer(small_model)
    env = build_env("reasoning", {"eval_size": 48}, 0)
    return [encode_prompt(tok, p.text) for p in env.eval_prompts()]


def hf_generator(model: str, device: str = "cuda"):
    from xrlhf.engines.hf import HFGenerateEngine

    return HFGenerateEngine(EngineSpec(model, device=device, options={"dtype": "float32"}))


def base_infer(model: str, device: str = "cuda"):
    """The model as saved, not perturbed: a scorer with other weights than the synced ones."""
    from xrlhf.engines.hf import HFInferEngine

    return HFInferEngine(EngineSpec(model, device=device, options=HF))


def trainer(model: str, device: str):
    from xrlhf.engines.hf import HFTrainEngine

    return HFTrainEngine(EngineSpec(model, device=device, options={"lr": 1e-3, **HF}))


def test_greedy_tokens_and_logprobs_equal_transformers(vllm_engine, small_model, prompts):
    ours, theirs = vllm_engine.generate(prompts, GREEDY), hf_generator(small_model).generate(prompts, GREEDY)
    mismatched = [i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b]
    first = mismatched[0] if mismatched else 0
    assert not mismatched, f"rows {mismatched[:5]}: vLLM {ours.token_ids[first]} HF {theirs.token_ids[first]}"
    for a, b in zip(ours.logprobs, theirs.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-3, rtol=0)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_logprobs_are_the_temperature_scaled_distribution(vllm_engine, small_model, prompts, top_p):
    """What the trainer recomputes (softmax(logits / T)) equals vLLM's logprobs when top_p is 1;
    with top_p < 1 vLLM's are of the renormalised nucleus, higher by log(nucleus mass)."""
    from xrlhf.engines.hf import HFInferEngine

    params = SamplingParams(temperature=0.7, top_p=top_p, max_new_tokens=16, seed=1)
    out = vllm_engine.generate(prompts, params)
    tok = load_tokenizer(small_model)
    batch = build_sequences(prompts, out.token_ids, tok.pad_token_id, out.logprobs)
    infer = HFInferEngine(EngineSpec(small_model, device="cuda", options=HF, temperature=0.7))
    recomputed, mask = infer.infer(batch)["logprobs"], batch["response_mask"].bool()
    diff = (batch["rollout_logprobs"] - recomputed)[mask]
    if top_p == 1.0:
        assert diff.abs().max() < 2e-3, float(diff.abs().max())
    else:
        assert diff.min() > -2e-3 and diff.max() > 1e-3  # log(1 / nucleus mass) >= 0


def perturbed(t, seed: int):
    g = torch.Generator(device=next(t.model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, device=p.device))
    return t


def check_sync(vllm_engine, small_model, prompts, t, transport):
    """Sync ``t``'s weights into the sleeping vLLM engine; then the read-back matches bit for bit
    and vLLM's logprobs of what it now generates are the trainer's."""
    before = vllm_engine.generate(prompts, GREEDY).token_ids
    vllm_engine.sleep()  # level 2: its weights are gone, the sync must bring every one back
    n = push_weights(transport, t.named_weights(), vllm_engine.receive_weights)
    vllm_engine.end_sync()
    weights = dict(t.named_weights())
    assert n == len(weights)
    compare_checksums({k: checksum(v) for k, v in weights.items()}, vllm_engine.weight_checksums(), "vLLM")
    after = vllm_engine.generate(prompts, GREEDY)
    assert after.token_ids != before
    # The second look is teacher-forced: the trainer scores vLLM's tokens. Free-running greedy
    # continuations of two different kernels part at near-ties of these noise-perturbed models
    # (seen on the GPU: 1 of 48 prompts at its first token), which says nothing about the sync.
    # In float32 the trainer's logprobs of vLLM's tokens were within 3.4e-3 of vLLM's on the GPU
    # (these noise-perturbed models have larger logits than the plain one, whose greedy test
    # holds 2e-3); the unperturbed weights, which vLLM held before some syncs, miss by far more.
    batch = build_sequences(prompts, after.token_ids, load_tokenizer(small_model).pad_token_id, after.logprobs)
    mask = batch["response_mask"].bool()
    diff = (batch["rollout_logprobs"] - t.infer(batch)["logprobs"].cpu())[mask].abs()
    other = (batch["rollout_logprobs"] - base_infer(small_model).infer(batch)["logprobs"].cpu())[mask].abs()
    assert diff.max() < 1e-2 and diff.mean() < 2e-3, (float(diff.max()), float(diff.mean()))
    assert other.mean() > 10 * diff.mean(), (float(other.mean()), float(diff.mean()))
    return float(diff.mean()), float(diff.max())


@pytest.mark.parametrize("name", ["cpu", "cuda_ipc", "disk"])
def test_same_gpu_transports_give_vllm_the_trainers_weights(vllm_engine, small_model, prompts, name):
    t = perturbed(trainer(small_model, "cuda:0"), seed=len(name))
    check_sync(vllm_engine, small_model, prompts, t, build_transport(name, bucket_bytes=4 << 20, verify=True))


def test_cuda_ipc_packed_buckets(vllm_engine, small_model, prompts):
    t = perturbed(trainer(small_model, "cuda:0"), seed=7)
    check_sync(vllm_engine, small_model, prompts, t,
               build_transport("cuda_ipc", bucket_bytes=4 << 20, verify=True, packed=True))


@pytest.mark.gpus(2)
def test_nccl_from_another_gpu_gives_vllm_the_trainers_weights(vllm_engine, small_model, prompts):
    t = perturbed(trainer(small_model, "cuda:1"), seed=11)
    transport = build_transport("nccl", bucket_bytes=4 << 20, verify=True, host="127.0.0.1", port=free_port(),
                                world_size=2, rank=0, timeout_s=120)
    check_sync(vllm_engine, small_model, prompts, t, transport)
    check_sync(vllm_engine, small_model, prompts, perturbed(t, seed=12), transport)  # the group is reused


@pytest.mark.gpus(2)
def test_cuda_ipc_across_gpus_is_refused_by_name(vllm_engine, small_model):
    t = trainer(small_model, "cuda:1")
    with pytest.raises(Exception, match="CUDA IPC needs both on one GPU"):
        push_weights(build_transport("cuda_ipc"), t.named_weights(), vllm_engine.receive_weights)
