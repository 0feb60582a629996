"""Reward sources: a function sees each prompt's reference answer when it asks for it; what it
returns must be numbers; failures and non-finite rewards are said on the console."""

from __future__ import annotations

import math

import pytest
from loguru import logger

from xrlhf.algorithms.rewards import FunctionReward, SafeReward
from xrlhf.envs import Prompt
from xrlhf.utils.errors import UserError

PROMPTS = [Prompt("2+3=", answer="5"), Prompt("4+4=", answer="8")]


@pytest.fixture()
def console():
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.rstrip("\n")), level="WARNING", format="{message}")
    yield lines
    logger.remove(sink)


def test_a_reward_function_receives_the_prompts_answers():
    scores, metrics = FunctionReward("tests.e2e.reward_fns:answer_reward")(PROMPTS, ["5", "7"], None)
    assert scores.tolist() == [1.0, 0.0] and metrics["reward/errors"] == 0


def test_two_argument_functions_still_work():
    scores, _ = FunctionReward("tests.e2e.reward_fns:length_reward")(PROMPTS, ["5", "12345"], None)
    assert scores.tolist() == [0.25, 1.0]


@pytest.mark.parametrize("returned,expected", [
    (lambda p, r: ["0.5" for _ in r], "returned '0.5' (a str) for sample 0 (prompt '2+3=', response '5'); "
                                      "a reward is a number"),
    (lambda p, r: "1", "returned '1' (a str); a reward source returns a list with one number per response"),
    (lambda p, r: [1.0], "returned 1 rewards for 2 responses"),
])
def test_non_numbers_are_named_not_reported_as_raising(returned, expected):
    with pytest.raises(UserError) as e:
        SafeReward("reward.function f", returned, "zero")(PROMPTS, ["5", "7"])
    (line,) = e.value.messages
    assert line == f"reward.function f: {expected}" and "raised" not in line


def test_numpy_and_torch_numbers_are_rewards():
    import numpy as np
    import torch

    assert SafeReward("f", lambda p, r: np.array([1, 0]), "fail")(PROMPTS, ["5", "7"]) == ([1.0, 0.0], 0)
    assert SafeReward("f", lambda p, r: [torch.tensor(0.5), np.float32(2)], "fail")(PROMPTS, ["5", "7"]) == (
        [0.5, 2.0], 0)


def test_zeroed_samples_and_nan_rewards_are_on_the_console(console):
    def half_raise(prompts, responses):
        if any(r == "7" for r in responses):
            raise ValueError("no sevens")
        return [1.0] * len(responses)

    values, errors = SafeReward("reward.function f", half_raise, "zero")(PROMPTS, ["5", "7"])
    assert (values, errors) == ([1.0, 0.0], 1)
    assert console == ["reward.function f: raised on 1 of 2 samples, scored 0 (fault_tolerance.reward_errors: "
                       "zero); first: ValueError: no sevens on sample 1 (prompt '4+4=', response '7')"]
    console.clear()
    values, _ = SafeReward("reward.function g", lambda p, r: [1.0, math.nan], "fail")(PROMPTS, ["5", "7"])
    assert console == ["reward.function g: 1 of 2 rewards are not finite; first: nan for sample 1 "
                       "(prompt '4+4=', response '7')"]


def test_the_reward_function_of_docs_extending_runs_as_written(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    (code,) = re.findall(r"```python\n(# mypkg/rewards\.py.*?)```", doc, re.S)
    (tmp_path / "docpkg").mkdir()
    (tmp_path / "docpkg" / "__init__.py").write_text("")
    (tmp_path / "docpkg" / "rewards.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    scores, _ = FunctionReward("docpkg.rewards:exact")([*PROMPTS, Prompt("x")], ["5", "9", "1"], None)
    assert scores.tolist() == pytest.approx([1.0, 0.1, 0.0])
