"""Real architectures through vLLM on a GPU (issue 17, item 6): Qwen2-style (grouped-query
attention, q/k/v biases, untied embeddings) and GPT-2-style (Conv1D) models built locally, every
weight perturbed and synced into a sleeping vLLM engine by each same-GPU transport with
verification on; then vLLM's logprobs of what it generates are the trainer's (teacher-forced;
the mismatch is printed: ``pytest -s``). And **stopping at EOS**: a few supervised steps teach the
model to end its answers with ``</s>``; synced into vLLM, its greedy answers stop there, token for
token what the Transformers generator gives. Run: ``pytest -m gpu -s tests/gpu/test_real_archs_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.gpu_helpers import generate_options
from tests.gpu.test_vllm_engine import check_sync, hf_generator, perturbed, trainer
from xrlhf.algorithms.losses import SFTLoss
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.models.archs import ARCHS, build_arch_model
from xrlhf.weight_sync import build_transport, push_weights

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    """(arch, model dir, a vLLM engine on it: float32, sleep level 2)."""
    from xrlhf.engines.vllm import VLLMGenerateEngine

    path = str(build_arch_model(tmp_path_factory.mktemp(request.param) / "model", request.param,
                                layers=4, hidden=256, heads=8))
    # the engine core in a process of its own: the trainer is this test's process (cuda_ipc)
    options = generate_options(gpu_memory_utilization=0.2, sleep_level=2, max_model_len=256, max_num_seqs=64,
                               multiprocessing=True)
    engine = VLLMGenerateEngine(EngineSpec(path, device="cuda", seed=0, options={**options, "dtype": "float32"}))
    yield request.param, path, engine
    engine.shutdown()


def prompts_of(path: str, n: int = 32) -> list[list[int]]:
    tok = load_tokenizer(path)
    return [tok.encode(f"{i % 17}+{i % 5}=", add_special_tokens=True) for i in range(n)]


@pytest.mark.parametrize("name", ["cpu", "cuda_ipc", "disk"])
def test_every_transport_syncs_a_perturbed_model(arch, name, capsys):
    kind, path, engine = arch
    t = perturbed(trainer(path, "cuda:0"), seed=len(name) + len(kind))
    mean, worst = check_sync(engine, path, prompts_of(path), t, build_transport(name, bucket_bytes=1 << 20, verify=True))
    with capsys.disabled():
        print(f"\nMISMATCH {kind} {name}: mean {mean:.2e} max {worst:.2e} nats/token (teacher-forced, float32)")


def test_stops_at_eos_like_transformers(arch):
    kind, path, engine = arch
    tok = load_tokenizer(path)
    t = trainer(path, "cuda:0")
    prompts = prompts_of(path, 64)
    answers = [tok.encode(str(i % 17 + i % 5), add_special_tokens=False) + [tok.eos_token_id] for i in range(64)]
    batch = build_sequences(prompts, answers, tok.pad_token_id)
    for _ in range(60):
        t.train_step(batch, SFTLoss())
    engine.sleep()
    push_weights(build_transport("cuda_ipc", bucket_bytes=1 << 20, verify=True), t.named_weights(),
                 engine.receive_weights)
    engine.end_sync()
    params = SamplingParams(temperature=0, max_new_tokens=32)
    ours = engine.generate(prompts, params)
    hf = hf_generator(path)
    hf.update_weights(t.named_weights())
    theirs = hf.generate(prompts, params)
    stopped = [ids for ids in ours.token_ids if ids and ids[-1] == tok.eos_token_id]
    assert len(stopped) >= 48, f"{kind}: {len(stopped)} of 64 answers ended at EOS: {ours.token_ids[:3]}"
    assert all(len(ids) < 32 for ids in stopped)
    assert ours.token_ids == theirs.token_ids
    for a, b in zip(ours.logprobs, theirs.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=5e-3, rtol=0)
