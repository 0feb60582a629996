"""Episodes through vLLM on a GPU (issue 15): one request per episode turn (continuous batching
across turns) gives the same trajectories as the Transformers engine's waves, and the episode
env ``calc`` runs through the vLLM engine with its tool.

Float32 small model (greedy decoding equal in vLLM and Transformers, tests/gpu/test_vllm_engine.py).
A random model never writes the template's ``</s>``, so every printable character stops a turn
here (as in tests/algorithms/test_episodes.py): short turns, several per episode.
Run on a GPU machine: ``pytest -m gpu tests/gpu/test_episodes_vllm.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.test_episodes import Echo
from tests.gpu.gpu_helpers import generate_options
from xrlhf.algorithms.rollout.episodes import EpisodeRunner, episode_metrics
from xrlhf.algorithms.local import LocalHandle
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.envs import build_env
from xrlhf.envs.episode import EpisodeOptions

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")

STOP = list(range(3, 128))


@pytest.fixture(scope="module")
def vllm_handle(small_model):
    options = generate_options(gpu_memory_utilization=0.25, sleep_level=0, max_model_len=256, max_num_seqs=128)
    spec = EngineSpec(small_model, device="cuda", seed=0, options={**options, "dtype": "float32"})
    handle = LocalHandle.build("policy", {"generate": ("vllm", spec)})
    yield handle
    handle.hosts[0].gen.shutdown()


def test_vllm_turn_requests_equal_transformers_waves(vllm_handle, small_model):
    tok = load_tokenizer(small_model)
    hf = LocalHandle.build("policy", {"generate": ("hf", EngineSpec(small_model, device="cuda", seed=0,
                                                                    options={"dtype": "float32"}))})
    env = Echo(EpisodeOptions(max_turns=3, max_episode_tokens=40))
    params = SamplingParams(temperature=0, max_new_tokens=4, stop_token_ids=STOP)
    prompts = env.train_prompts(0, 48)
    seeds = list(range(48))
    ours = EpisodeRunner(env, tok, vllm_handle, continuous=True).run(prompts, seeds, params)
    theirs = EpisodeRunner(env, tok, hf).run(prompts, seeds, params)
    assert [t.tokens for t in ours] == [t.tokens for t in theirs]
    assert [t.loss_mask for t in ours] == [t.loss_mask for t in theirs]
    assert sum(t.turns >= 2 for t in ours) >= 24
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-3, rtol=0)


def test_calc_episodes_with_the_tool_through_vllm(vllm_handle, small_model):
    """Sampled episodes of the calculator env: the runner's bookkeeping holds for every one."""
    tok = load_tokenizer(small_model)
    env = build_env("calc", {"max_turns": 3, "max_episode_tokens": 48}, seed=0)
    runner = EpisodeRunner(env, tok, vllm_handle, continuous=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=STOP)
    prompts = env.train_prompts(0, 128)
    trajs = runner.run(prompts, list(range(128)), params)
    for t in trajs:
        assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs) == len(t.versions) <= 48
        assert sum(t.loss_mask) >= t.turns and 1 <= t.turns <= 3
    m = episode_metrics(trajs)  # a random model's one-character turns are answers: mostly one turn
    assert {"episode/turns_mean", "episode/tool_calls_mean", "episode/tool_errors_mean"} <= set(m)
