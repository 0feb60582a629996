"""Ray handles on CPU: 2 data-parallel ranks (gloo) update weights exactly as 1 rank does."""

from __future__ import annotations

import pytest
import torch

from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.config.schema import XConfig
from xrlhf.coordinator import Coordinator
from xrlhf.topology import topology
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, load_tokenizer

pytestmark = pytest.mark.usefixtures("ray_session")  # runs handles in this process


def rl_batch(tok, n=8):
    g = torch.Generator().manual_seed(0)
    prompts = [encode_prompt(tok, f"{i}+{i + 1}=") for i in range(n)]
    responses = [tok.encode(str(i * 3)[: 1 + i % 3], add_special_tokens=False) + [tok.eos_token_id] for i in range(n)]
    batch = build_sequences(prompts, responses, tok.pad_token_id)
    mask = batch["response_mask"]
    batch["old_logprobs"] = -torch.rand(mask.shape, generator=g) * mask
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    return batch


def train_with_ranks(config: dict, ranks: int, batch) -> dict[str, torch.Tensor]:
    data = {**config, "critic": None, "reference": None}
    data["policy"] = {**config["policy"], "resources": {"ranks": ranks, "cpus_per_rank": 0.5}}
    # no generators (generate=False): each is a process to start, and the test trains only
    coord = Coordinator(topology(XConfig.model_validate(data), config["policy"]["model"], generate=False)).start()
    try:
        policy = coord["policy"]
        for _ in range(2):
            metrics = policy.train_step(batch, PolicyLoss(clip_eps=0.2, entropy_coef=0.01))
        assert metrics["grad_norm"] > 0
        states = [s["model"] for s in policy._get([w.state_dict.remote() for w in policy.workers],
                                                  list(range(ranks)))]
    finally:
        coord.shutdown()
    for other in states[1:]:  # every rank holds the same weights after a step
        for k in states[0]:
            torch.testing.assert_close(states[0][k], other[k])
    return states[0]


@pytest.mark.parametrize("rows", [pytest.param(8, marks=pytest.mark.long), 5])  # 8: make test-all (CI) only
def test_two_ranks_equal_one_rank(base_config, tiny_model, rows):
    """8 rows: 4 per rank; 5 rows: 3 + (2 and a padding copy that weighs nothing)."""
    tok = load_tokenizer(tiny_model)
    base_config["policy"]["train"] = {"lr": 1e-3, "micro_batch_size": 3}
    batch = rl_batch(tok, rows)
    one = train_with_ranks(base_config, 1, batch)
    two = train_with_ranks(base_config, 2, batch)
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    moved = max(float((one[k] - initial[k]).abs().max()) for k in one)
    assert moved > 1e-4, "the step must change the weights"
    for k in one:
        # Adam divides by |grad|: fp32 summation-order noise appears at ~1e-6 of a step
        torch.testing.assert_close(one[k], two[k], atol=2e-5, rtol=1e-4, msg=k)
