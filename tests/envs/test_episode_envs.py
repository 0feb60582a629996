"""The built-in episode envs, turn by turn (issue 15): calc (with and without its calculator),
multiturn_qa (tries, feedback, discount, first-try counter) and guess (hints, invalid guesses,
binary-search demonstrations). Pure env logic: no model, no Ray."""

from __future__ import annotations

import math
import threading

import pytest
from loguru import logger

from xrlhf.envs import build_env
from xrlhf.envs.base import ENVS
from xrlhf.tools import Tool, ToolResult


def calc(**options):
    return build_env("calc", {"eval_size": 8, **options}, seed=0)


def play(env, prompt, actions):
    """The turns ``actions`` produce in a fresh episode of ``prompt`` (stops at ``done``)."""
    episode, turns = env.start(prompt), []
    for a in actions:
        turns.append(episode.step(a))
        if turns[-1].done:
            break
    return turns


def test_calc_tool_call_then_copied_answer_earns_the_reward():
    env = calc()
    p = env.train_prompts(0, 1)[0]
    a, b = p.text.rstrip("=").split("*")
    assert len(a) == len(b) == 3 and p.answer == str(int(a) * int(b))
    call, answer = play(env, p, [f"<tool_call>calculator: {a}*{b}</tool_call>", p.answer])
    assert call.observation == {"role": "tool", "content": p.answer} and not call.done
    assert call.info == {"tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}
    assert answer.done and answer.correct and answer.reward == 1.0


def test_calc_tool_errors_are_observations_and_wrong_answers_score_zero():
    env = calc()
    p = env.train_prompts(3, 1)[0]
    bad_expr, unknown, unclosed, wrong = play(env, p, ["<tool_call>calculator: 2**</tool_call>",
                                                       "<tool_call>abacus: 1+1</tool_call>",
                                                       "<tool_call>calculator: 1+1", "12"])
    for t in (bad_expr, unknown, unclosed):
        assert not t.done and t.info["tool_errors"] == 1.0 and t.observation["content"].startswith("error:")
    assert "unknown tool 'abacus'" in unknown.observation["content"]
    assert wrong.done and wrong.correct is False and wrong.reward == 0.0


class Hang(Tool):
    """A trusted tool that never answers (until the test lets it go)."""

    name = "hang"
    description = "never answers"
    release = threading.Event()

    def run(self, arguments):
        self.release.wait(60)
        return ToolResult("late")


def test_calc_a_stuck_tool_is_an_error_observation_a_counter_and_a_log_line():
    lines = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    tools = [{"name": "calculator"},
             {"name": "tests.envs.test_episode_envs:Hang", "options": {"sandbox": "none", "timeout_s": 0.2}}]
    env = calc(tools=tools)
    try:
        p = env.train_prompts(0, 1)[0]
        stuck, answer = play(env, p, ["<tool_call>hang: now</tool_call>", p.answer])
    finally:
        type(env.tools["hang"]).release.set()  # the class the env imported by path (another module object)
        logger.remove(sink)
    assert stuck.observation == {"role": "tool", "content": "error: timed out after 0.2 s (the call was abandoned)"}
    assert stuck.info == {"tool_calls": 1.0, "tool_errors": 1.0, "tool_timeouts": 1.0} and answer.correct
    (line,) = [x for x in lines if "timed out" in x]
    assert f"env CalcEnv, prompt {p.text!r}: tool 'hang' timed out after 0.2 s on 'now'" in line


def test_calc_without_tools_answers_directly_and_demonstrations_follow_the_fraction():
    no_tool = calc(tools=[])
    p = no_tool.train_prompts(0, 1)[0]
    (turn,) = play(no_tool, p, [f"<tool_call>calculator: {p.text.rstrip('=')}</tool_call>"])
    assert turn.done and turn.reward == 0.0  # a call is just a (wrong) answer without tools
    convs = calc(sft_tool_fraction=0.3).sft_conversations(0, 400)
    with_tool = sum(any(m["role"] == "tool" for m in c) for c in convs) / len(convs)
    assert 0.22 < with_tool < 0.38
    assert all(c[-1]["role"] == "assistant" for c in convs)
    assert not any(m["role"] == "tool" for c in no_tool.sft_conversations(0, 50) for m in c)


def test_calc_eval_split_is_held_out():
    env = calc(eval_size=64)
    train = {p.text for p in env.train_prompts(0, 2000)}
    assert not train & {p.text for p in env.eval_prompts()}


def mq(**options):
    return build_env("multiturn_qa", {"problems": {"tasks": ["add"], "eval_size": 4}, **options}, seed=0)


def test_multiturn_qa_right_first_try():
    env = mq()
    p = env.train_prompts(0, 1)[0]
    (t,) = play(env, p, [p.answer])
    assert t.done and t.correct and t.reward == 1.0 and t.info == {"first_turn_correct": 1.0, "retries": 0.0}


def test_multiturn_qa_feedback_and_discount():
    env = mq(discount=0.5)
    p = env.train_prompts(1, 1)[0]
    wrong, right = play(env, p, ["x", p.answer])
    assert wrong.observation == {"role": "user", "content": "wrong, try again"} and not wrong.done
    assert right.done and right.correct and right.reward == 0.5
    assert right.info == {"first_turn_correct": 0.0, "retries": 1.0}


def test_multiturn_qa_last_wrong_try_loses_without_truncation():
    env = mq(max_turns=3)
    turns = play(env, env.train_prompts(2, 1)[0], ["x", "y", "z", "never sent"])
    assert len(turns) == 3 and turns[-1].done and turns[-1].correct is False
    assert turns[-1].reward == 0.0 and turns[-1].observation is None


def guess(**options):
    return build_env("guess", {"max_number": 16, **options}, seed=0)


def test_guess_hints_invalid_guesses_and_losing():
    env = guess(max_turns=3)
    p = env.eval_prompts()[4]  # secret 5
    assert p.answer == "5"
    low, invalid, high = play(env, p, ["3", "seven", "9"])
    assert low.observation["content"] == "higher" and invalid.info["invalid_guesses"] == 1.0
    assert "a number from 1 to 16" in invalid.observation["content"]
    assert high.done and high.correct is False and high.reward == 0.0  # third guess: out of turns
    found = play(guess(), p, ["8", "4", "6", "5"])
    assert found[-1].done and found[-1].correct and found[-1].reward == pytest.approx(0.9 ** 3)


@pytest.mark.parametrize("max_number", [16, 100])
def test_guess_demonstrations_are_binary_searches_that_win(max_number):
    env = guess(max_number=max_number, max_turns=8)
    prompts = {p.index: p for p in env.train_prompts(0, 64)}
    for i, conv in enumerate(env.sft_conversations(0, 64)):
        guesses = [m["content"] for m in conv if m["role"] == "assistant"]
        assert len(guesses) <= math.ceil(math.log2(max_number + 1))
        turns = play(env, prompts[i], guesses)
        assert turns[-1].done and turns[-1].correct


def test_docs_episode_env_example_runs_as_written(tmp_path, monkeypatch):
    """docs/episodes.md's "Your own episode env" block: importable, registered, playable."""
    import re
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "episodes.md").read_text()
    (code,) = re.findall(r"```python\n# my_pkg/envs\.py\n(.*?)```", doc, re.S)
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ENVS, "_items", dict(ENVS._items))  # the page's registration stays here
    try:
        env = build_env("my_pkg.envs:SayWordEnv", {"word": "hi", "max_turns": 2}, seed=0)
        p = env.train_prompts(0, 1)[0]
        retry, ok = play(env, p, ["hello", "hi"])
        assert retry.observation == {"role": "user", "content": "say hi"} and ok.done and ok.reward == 1.0
    finally:
        for m in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
            del sys.modules[m]
