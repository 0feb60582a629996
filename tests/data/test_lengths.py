"""A prompt plus max_new_tokens beyond the model's positions is one line, for learned (GPT-2)
and rotary (Llama) positions alike, in the trainer as in validation; never an IndexError."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.conftest import build_gpt2
from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.rollout.types import Tally
from xrlhf.data.lengths import check_prompt_lengths, model_positions
from xrlhf.data.text import load_tokenizer
from xrlhf.envs import Prompt, build_env
from xrlhf.models.tiny import build_model
from xrlhf.utils.errors import UserError
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.utils.run_hooks import RunHooks


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def short_model(request, tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        return build_gpt2(root / "m", positions=32), "n_positions"
    return str(build_model(root / "m", seed=0, max_positions=32)), "max_position_embeddings"


def test_model_positions(short_model):
    path, key = short_model
    assert model_positions(path) == (32, key)


def test_check_prompt_lengths_names_the_prompt_and_the_limit(short_model):
    path, key = short_model
    check_prompt_lengths([[1] * 24], ["ok"], 8, path)
    with pytest.raises(UserError) as e:
        check_prompt_lengths([[1] * 5, [1] * 25], ["short", "a long prompt"], 8, path)
    (line,) = e.value.messages
    assert line.startswith("policy.generate.max_new_tokens: the prompt 'a long prompt' (25 tokens) + max_new_tokens 8 "
                           f"= 33 exceeds the 32 positions of {path} ({key} in config.json;")


class NoGenerate:
    world_size = 1

    def generate(self, ids, params, seeds=None, wait=True):
        raise AssertionError("generate must not be reached with a prompt the model cannot hold")


def test_a_rollout_with_a_too_long_prompt_stops_with_one_line(short_model):
    path, _ = short_model
    cfg = validate_dict({"env": {"name": "reasoning"}, "policy": {"model": path, "generate": {"max_new_tokens": 8}},
                         "reference": None, "algorithm": {"name": "grpo", "kl_coef": 0, "mini_batch_size": 4},
                         "trainer": {"prompts_per_step": 2, "samples_per_prompt": 2}})
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    policy = NoGenerate()
    handles = SimpleNamespace(policy=policy, generator=policy, critic=None, reference=None, reward=None)
    trainer = build_trainer(cfg, algorithm_options(cfg), handles, env,
                            load_tokenizer(path), reward=None, hooks=RunHooks())
    with pytest.raises(UserError, match=r"the prompt 'sort 1 2 3 4 5 6 7 8 9 0 1 2:' \(30 tokens\) \+ max_new_tokens 8"):
        trainer.collector.sampler.groups([Prompt("2+2="), Prompt("sort 1 2 3 4 5 6 7 8 9 0 1 2:")], 1, 0, Tally())


def test_episode_env_names_its_budget_and_counts_each_turn_once(tmp_path):
    """An episode's sequence is its first prompt plus max_episode_tokens (each turn's
    max_new_tokens is cut to what is left of it): that is what must fit, and what to lower."""
    from xrlhf.data.text import encode_prompt

    path = str(build_model(tmp_path / "m", seed=0, max_positions=64))
    env = build_env("calc", {"eval_size": 8}, 0)
    longest = env.max_prompt_tokens(load_tokenizer(path))
    assert longest == max(len(encode_prompt(load_tokenizer(path), p)) for p in env.eval_prompts() +
                          env.train_prompts(0, 256))

    def config(budget: int) -> dict:
        return {"env": {"name": "calc", "options": {"eval_size": 8, "max_episode_tokens": budget}},
                "policy": {"model": path, "generate": {"max_new_tokens": 16}}, "reference": None,
                "algorithm": {"name": "grpo", "kl_coef": 0, "mini_batch_size": 4},
                "trainer": {"prompts_per_step": 2, "samples_per_prompt": 2}}

    validate_dict(config(64 - longest))  # fits exactly, though a turn's max_new_tokens would overflow on top of it
    with pytest.raises(UserError) as e:
        validate_dict(config(64 - longest + 1))
    (line,) = e.value.messages
    assert line.startswith(f"env.options.max_episode_tokens: the longest prompt of env 'calc' ({longest} tokens) + "
                           f"max_episode_tokens {65 - longest} (the episode's turns and observations; each turn's "
                           f"max_new_tokens counts within it) = 65 exceeds the 64 positions of {path}")
    assert line.endswith(f"lower it to at most {64 - longest}")
