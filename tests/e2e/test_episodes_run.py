"""Short end-to-end runs of the episode configs through Ray (issue 15): tool_calc with GRPO (and
one-step-off), guess with PPO (per-turn rewards through GAE), multiturn_qa with online KTO and
with a reward function scoring the whole conversation; plus the config errors of bad tools. One
Ray serves all of them; each run is 2 steps after a 4-step warm-up. tool_calc's synchronous run
keeps the shipped two policy ranks (episodes spread over two generators); the others run on one
(``ONE_RANK``: each rank is a process of its own, with its generator, ~7 CPU-s to start on the
2-core box)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xrlhf.models.tiny import build_model
from xrlhf.utils.errors import UserError
from xrlhf.validation import load_config

REPO = Path(__file__).resolve().parents[2]
SHORT = ["trainer.steps=2", "trainer.eval_every=1", "trainer.eval_size=8", "warmup.steps=4", "warmup.batch_size=16",
         "policy.train.micro_batch_size=16", "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4",
         "algorithm.mini_batch_size=16", "trainer.save_final=false"]
ONE_RANK = "policy.resources.ranks=1"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_model(tmp_path_factory.mktemp("episodes_e2e") / "tiny-char"))


@pytest.fixture(scope="module")
def ray_session(model):
    import ray

    from tests.conftest import start_ray

    start_ray(load_config(REPO / "configs" / "tool_calc.yaml", [f"policy.model={model}"]).ray)
    yield
    ray.shutdown()


def run_config(name: str, out: Path, model: str, overrides: list[str]) -> list[dict]:
    from xrlhf.runner import run

    summary = run(load_config(REPO / "configs" / f"{name}.yaml", [*SHORT, f"policy.model={model}", *overrides]), out)
    assert summary["steps"] == 2 and isinstance(summary["eval_reward_final"], float)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step") and "time/step_s" in r]
    assert len(steps) == 2
    for key in ("episode/turns_mean", "episode/tokens_mean", "episode/truncated_frac"):
        assert all(key in s for s in steps), key
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert all("eval/turns_mean" in r for r in evals)
    return steps


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_tool_calc_grpo_sync_and_one_step_off(model, ray_session, tmp_path):
    steps = run_config("tool_calc", tmp_path / "sync", model, [])
    assert all("episode/tool_calls_mean" in s and "episode/tool_errors_mean" in s for s in steps)
    steps = run_config("tool_calc", tmp_path / "async", model,
                       [ONE_RANK, "rollout.max_staleness=1", "algorithm.off_policy={correction: tis, cap: 2.0}"])
    assert [s["staleness/max"] for s in steps] == [0, 1]


def test_guess_ppo_with_turn_rewards(model, ray_session, tmp_path):
    steps = run_config("guess", tmp_path, model, [ONE_RANK, "algorithm.name=ppo", "critic={}", "algorithm.ppo_epochs=1",
                                                  "algorithm.kl_coef=0.01"])
    assert all("critic/loss" in s and "episode/invalid_guesses_mean" in s for s in steps)


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_multiturn_qa_online_kto_and_reward_function(model, ray_session, tmp_path):
    steps = run_config("multiturn_qa", tmp_path / "kto", model, [ONE_RANK, "algorithm={name: kto_online, mini_batch_size: 16}"])
    assert all("kto/desirable_fraction" in s and "episode/first_turn_correct_mean" in s for s in steps)
    run_config("multiturn_qa", tmp_path / "fn", model,
               [ONE_RANK, "reward.source=function", "reward.function=tests.e2e.reward_fns:length_reward"])


@pytest.mark.parametrize("tools, message", [
    ("[{name: calcx}]", r"env.options.tools\[0\].name: unknown tool 'calcx'; valid: calculator, python"),
    ("[{name: calculator, options: {timeout_s: -1}}]", r"env.options.tools\[0\].options.timeout_s"),
    ("[{name: calculator}, {name: calculator}]", r"env.options.tools\[1\]"),
])
def test_bad_tools_are_config_errors(model, tools, message):
    from xrlhf.validation import validate_dict
    from xrlhf.config.loader import read_yaml

    data = read_yaml(REPO / "configs" / "tool_calc.yaml")
    data["policy"]["model"] = model
    import yaml

    data["env"]["options"]["tools"] = yaml.safe_load(tools)
    with pytest.raises(UserError, match=message):
        validate_dict(data)
