"""``xrlhf make-dataset``: rows from the reasoning env, wrong answers that are well-formed."""

import argparse
import json
import random

import pytest

from xrlhf.data.datasets import KTO, PREFERENCE, PROMPTS, load_rows
from xrlhf.envs.reasoning import ReasoningEnv, ReasoningOptions, is_held_out
from xrlhf.envs.synthetic import add_arguments, make_rows, run, source_prompts, wrong_answer
from xrlhf.utils.errors import UserError


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_wrong_answers_are_well_formed_and_wrong():
    opts = ReasoningOptions()
    env = ReasoningEnv(opts, seed=0)
    prompts = env.train_prompts(0, 400)
    rng = random.Random(0)
    wrong = [wrong_answer(p, rng, opts) for p in prompts]
    scores = env.score(prompts, wrong)
    assert not any(s.correct for s in scores)
    assert all(s.info["well_formed"] for s in scores)


@pytest.mark.parametrize("kind,schema", [("preferences", PREFERENCE), ("kto", KTO), ("qa", PROMPTS)])
def test_cli_writes_loadable_rows(tmp_path, kind, schema):
    out = tmp_path / f"{kind}.jsonl"
    assert run(parse(kind, str(out), "--rows", "50", "--seed", "3")) == 0
    rows = load_rows(out, schema)
    assert len(rows) == 50
    again = tmp_path / "again.jsonl"
    run(parse(kind, str(again), "--rows", "50", "--seed", "3"))
    assert out.read_text() == again.read_text()  # a function of its arguments


def test_rows_are_right_and_kto_labels_match():
    opts = ReasoningOptions()
    env = ReasoningEnv(opts, seed=0)
    prompts = source_prompts(opts, 200, "train", seed=1)
    pairs = make_rows("preferences", prompts, opts, 1)
    assert all(s.correct for s in env.score(prompts, [r["chosen"] for r in pairs]))
    assert not any(s.correct for s in env.score(prompts, [r["rejected"] for r in pairs]))
    kto = make_rows("kto", prompts, opts, 1, desirable_fraction=0.3)
    scores = env.score(prompts, [r["completion"] for r in kto])
    assert [r["label"] for r in kto] == [s.correct for s in scores]
    assert 0.15 < sum(r["label"] for r in kto) / len(kto) < 0.45


def test_eval_split_prompts_are_held_out_problems(tmp_path):
    out = tmp_path / "e.jsonl"
    run(parse("qa", str(out), "--rows", "40", "--split", "eval", "--tasks", "add,parity"))
    train = {p.text for p in ReasoningEnv(ReasoningOptions(tasks=["add", "parity"]), 0).train_prompts(0, 2000)}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and not {r["prompt"] for r in rows} & train
    a, b = rows[0]["prompt"][:-1].split("+")
    assert is_held_out("add", int(a) * 21 + int(b), ReasoningOptions(tasks=["add", "parity"]))


def test_bad_flags_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="--rows: must be >= 1"):
        run(parse("qa", str(tmp_path / "x.jsonl"), "--rows", "0"))
    with pytest.raises(UserError, match="make-dataset --tasks"):
        run(parse("qa", str(tmp_path / "x.jsonl"), "--tasks", "add,divide"))
