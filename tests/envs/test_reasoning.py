"""The reasoning environment: determinism, a disjoint eval split, scoring, options, registry."""

import pytest
from pydantic import BaseModel, ValidationError

from xrlhf.envs import ENVS, Env, Prompt, Score, build_env, register_env
from xrlhf.envs.reasoning import TASKS, ReasoningEnv, ReasoningOptions, is_held_out


@register_env("my_env")
class MyEnv(Env):
    """An environment defined outside xrlhf, with its own options."""

    class Config(BaseModel, extra="forbid"):
        word: str = "hi"

    def train_prompts(self, start, n):
        return [Prompt(f"say {self.config.word}", self.config.word, "say", i) for i in range(start, start + n)]

    def eval_prompts(self):
        return self.train_prompts(0, 1)


def test_same_seed_same_prompts_other_seed_others():
    a, b, c = (build_env("reasoning", {}, seed) for seed in (0, 0, 1))
    assert a.train_prompts(0, 200) == b.train_prompts(0, 200)
    assert a.eval_prompts() == b.eval_prompts()
    assert a.train_prompts(0, 200) != c.train_prompts(0, 200)
    assert a.train_prompts(50, 10) == a.train_prompts(0, 60)[50:]  # resuming is one integer
    assert [p.index for p in a.train_prompts(7, 3)] == [7, 8, 9]


def test_eval_split_disjoint_from_training():
    for seed in (0, 1):
        env = build_env("reasoning", {}, seed)
        eval_texts = {p.text for p in env.eval_prompts()}
        train_texts = {p.text for p in env.train_prompts(0, 5000)}
        assert len(env.eval_prompts()) == 256 and not eval_texts & train_texts
    # A tiny problem space still has both splits (1 of 4 add problems held out).
    env = build_env("reasoning", {"tasks": ["add"], "max_operand": 1, "eval_size": 8}, 0)
    assert {p.text for p in env.eval_prompts()}.isdisjoint(p.text for p in env.train_prompts(0, 200))


def test_held_out_share_is_an_eighth_of_each_task():
    opts = ReasoningOptions()
    for name, task in TASKS.items():
        size = task.size(opts)
        assert sum(is_held_out(name, i, opts) for i in range(size)) == max(1, size // 8)


def test_tasks_take_turns_and_prompts_are_short():
    prompts = build_env("reasoning", {}, 0).train_prompts(0, 400)
    assert [p.task for p in prompts[:4]] == ["add", "compare", "sort", "parity"]
    assert max(len(p.text) for p in prompts) <= 16
    assert {p.answer for p in prompts if p.task == "compare"} == {"<", ">", "="}


@pytest.mark.parametrize("task, text, answer, right, formed_wrong, malformed", [
    ("add", "12+7=", "19", " 19</s>", "18", "nineteen"),
    ("compare", "12?7=", ">", ">\n", "<", "greater"),
    ("sort", "sort 3 1 2:", "1 2 3", "1 2 3 </s>", "3 2 1", "123"),
    ("parity", "parity 1011:", "odd", "odd", "even", "1"),
])
def test_score_right_wrong_and_malformed(task, text, answer, right, formed_wrong, malformed):
    env = build_env("reasoning", {"reward_correct": 2.0, "reward_format": 0.5}, 0)
    p = Prompt(text, answer, task)
    scores = env.score([p, p, p], [right, formed_wrong, malformed])
    assert [s.reward for s in scores] == [2.0, 0.5, 0.0]
    assert [s.correct for s in scores] == [True, False, False]
    assert all(s.info["task"] == task for s in scores)


def test_generated_answers_are_right():
    env = build_env("reasoning", {}, 0)
    prompts = env.train_prompts(0, 40)
    assert all(s.correct for s in env.score(prompts, [p.answer for p in prompts]))
    by_text = {p.text: p.answer for p in prompts}
    for text, answer in by_text.items():
        if "+" in text:
            a, b = map(int, text[:-1].split("+"))
            assert answer == str(a + b)
    assert env.sft_examples(0, 2) == [(p.text, p.answer) for p in prompts[:2]]


def test_score_needs_one_response_per_prompt():
    env = build_env("reasoning", {}, 0)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        env.score(env.train_prompts(0, 2), ["1"])


@pytest.mark.parametrize("options, where", [
    ({"max_operands": 5}, "max_operands"),
    ({"max_operand": 0}, "max_operand"),
    ({"tasks": ["add", "multiply"]}, "tasks.1"),
    ({"tasks": []}, "at least one task"),
    ({"tasks": ["add", "add"]}, "listed more than once"),
    ({"reward_format": 2.0}, "lower reward_format"),
])
def test_bad_options_raise_validation_error(options, where):
    with pytest.raises(ValidationError, match=where):
        build_env("reasoning", options, 0)


def test_registry_custom_env_duplicate_and_import_path():
    env = build_env("my_env", {"word": "yo"}, 0)
    assert isinstance(env, MyEnv) and env.eval_prompts()[0].answer == "yo"
    assert env.sft_examples(0, 1) == [("say yo", "yo")]
    with pytest.raises(NotImplementedError, match="MyEnv has no rule reward"):
        env.score(env.eval_prompts(), ["yo"])
    with pytest.raises(ValidationError):
        build_env("my_env", {"wrod": "yo"}, 0)
    with pytest.raises(ValueError, match="already registered"):
        register_env("my_env")(ReasoningEnv)
    assert isinstance(build_env("xrlhf.envs.reasoning:ReasoningEnv", {"tasks": ["sort"]}, 0), ReasoningEnv)
    with pytest.raises(KeyError, match="reasoning"):
        build_env("no_such_env", {}, 0)
    with pytest.raises(TypeError, match="not a subclass"):
        build_env("xrlhf.envs.base:Score", {}, 0)
    assert {"reasoning", "my_env"} <= set(ENVS.names())
    assert isinstance(Score(1.0).info, dict)
