"""The ``qa`` environment: prompts from a dataset, a held-out split, rewards from a reward model."""

import pytest

from xrlhf.validation import validate_dict
from xrlhf.data.datasets import held_out, write_jsonl
from xrlhf.envs import ENVS, build_env
from xrlhf.envs.qa import QAEnv
from xrlhf.utils.errors import UserError


@pytest.fixture
def qa_file(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(12) for b in range(12)]
    return write_jsonl(rows, tmp_path / "qa.jsonl")


def test_registered_and_scored_by_a_model():
    assert ENVS.get("qa") is QAEnv
    assert QAEnv.reward_source == "model"


def test_hashed_split_is_disjoint_deterministic_and_seed_independent(qa_file):
    env = build_env("qa", {"dataset": str(qa_file), "eval_fraction": 0.2}, seed=0)
    evals = {p.text for p in env.eval_prompts()}
    train = {p.text for p in env.train_prompts(0, 500)}
    assert evals and train and not evals & train
    assert len(train) + len(evals) == 144  # 500 draws cover every training row (3+ epochs)
    assert evals == {p.text for p in build_env("qa", {"dataset": str(qa_file), "eval_fraction": 0.2}, 7).eval_prompts()}
    assert all(held_out(t, 0.2) for t in evals)


def test_training_stream_is_a_function_of_seed_and_index(qa_file):
    opts = {"dataset": str(qa_file)}
    a, b = build_env("qa", opts, seed=1), build_env("qa", opts, seed=1)
    assert a.train_prompts(130, 20) == b.train_prompts(130, 20)  # crosses an epoch boundary
    assert [p.index for p in a.train_prompts(5, 3)] == [5, 6, 7]
    assert a.train_prompts(0, 10) != build_env("qa", opts, seed=2).train_prompts(0, 10)
    n = len(a._splits[0])
    epoch0 = [p.text for p in a.train_prompts(0, n)]
    assert sorted(epoch0) == sorted(p.text for p in a._splits[0])  # each epoch visits every row once


def test_eval_dataset_and_answers(tmp_path, qa_file):
    held = write_jsonl([{"prompt": "99+1="}, {"prompt": "98+1=", "answer": "99"}], tmp_path / "e.jsonl")
    env = build_env("qa", {"dataset": str(qa_file), "eval_dataset": str(held)}, seed=0)
    assert [(p.text, p.answer) for p in env.eval_prompts()] == [("99+1=", None), ("98+1=", "99")]
    assert len(env.train_prompts(0, 144)) == 144
    prompt, target = env.sft_examples(0, 1)[0]
    assert target == str(sum(int(x) for x in prompt[:-1].split("+")))  # the reference answer
    with pytest.raises(NotImplementedError, match="reward model"):
        env.score(env.eval_prompts(), ["1", "2"])


def test_prompts_without_answers_have_no_warmup(tmp_path):
    path = write_jsonl([{"prompt": f"q{i}"} for i in range(40)], tmp_path / "q.jsonl")
    env = build_env("qa", {"dataset": str(path), "eval_fraction": 0.3}, seed=0)
    with pytest.raises(NotImplementedError, match="no answer"):
        env.sft_examples(0, 2)


def test_bad_row_is_named_when_the_env_reads_its_data(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    env = build_env("qa", {"dataset": str(path)}, seed=0)
    with pytest.raises(UserError, match=r"q.jsonl:2: missing field 'prompt'"):
        env.eval_prompts()


def test_config_needs_a_reward_model_or_function(tmp_path, qa_file):
    from xrlhf.models.tiny import build_model

    model = str(build_model(tmp_path / "m"))
    base = {"env": {"name": "qa", "options": {"dataset": str(qa_file)}}, "policy": {"model": model},
            "algorithm": {"name": "grpo"}, "trainer": {"samples_per_prompt": 2}}
    with pytest.raises(UserError, match=r"reward.source: env 'qa' has no rule reward"):
        validate_dict(base)
    assert validate_dict({**base, "reward": {"source": "model", "model": model}}).reward.source == "model"
    with pytest.raises(UserError, match=r"env.options.eval_fraction: 0 holds no prompts out"):
        validate_dict({**base, "env": {"name": "qa", "options": {"dataset": str(qa_file), "eval_fraction": 0}},
                       "reward": {"source": "model", "model": model}})
