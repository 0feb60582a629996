"""``xrlhf make-dataset arithmetic``: deterministic word problems whose worked answers verify."""

import argparse
import json
import re

import pytest

from xrlhf.envs.synthetic import SHIPPED, add_arguments, recipe, run
from xrlhf.envs.verifiers import exact, numeric
from xrlhf.envs.word_problems import TEMPLATES, make_rows
from xrlhf.utils.errors import UserError


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rows_are_a_function_of_seed_and_index():
    rows = make_rows(40, seed=3)
    assert rows == make_rows(40, seed=3)
    assert make_rows(10, seed=3) == rows[:10]  # a longer file begins with a shorter one
    assert make_rows(40, seed=4) != rows
    assert [r["task"] for r in rows[:4]] == list(TEMPLATES)
    assert {r["task"] for r in make_rows(6, 0, tasks=["multiply"])} == {"multiply"}
    assert len({r["prompt"] for r in make_rows(400, 0)}) > 390  # few repeats


def test_the_first_problem_reads_as_the_example():
    row = make_rows(1, seed=0, tasks=["add"])[0]
    m = re.fullmatch(r"(\w+) has (\d+) (\w+) and buys (\d+) more\. How many \3 does (he|she) have now\?", row["prompt"])
    assert m, row
    assert row["answer"] == str(int(m[2]) + int(m[4]))
    assert row["demonstration"].endswith(f"The answer is {row['answer']}")


def test_answers_are_right_and_verify_against_their_own_demonstrations():
    rows = make_rows(800, seed=1, max_operand=30)
    for r in rows:
        assert numeric(r["demonstration"], r["answer"]) == 1.0, r
        assert exact(r["demonstration"].rsplit(" ", 1)[-1], r["answer"]) == 1.0  # it ends in the number
        for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", r["demonstration"]):
            assert eval(f"{a}{op}{b}") == int(c), r  # every step of the worked answer is right
        assert int(r["answer"]) >= 1
        numbers = [int(n) for n in re.findall(r"\d+", r["prompt"])]
        assert max(numbers) <= 30


def test_cli_writes_the_file_the_dataset_env_reads(tmp_path):
    from xrlhf.envs import build_env

    out = tmp_path / "arith.jsonl"
    assert run(parse("arithmetic", str(out), "--rows", "60", "--seed", "2")) == 0
    again = tmp_path / "again.jsonl"
    run(parse("arithmetic", str(again), "--rows", "60", "--seed", "2"))
    assert out.read_text() == again.read_text()
    assert [json.loads(line) for line in out.read_text().splitlines()] == make_rows(60, 2)
    env = build_env("dataset", {"dataset": str(out), "verifier": "numeric", "demonstration_column": "demonstration",
                                "eval_fraction": 0.2}, 0)
    prompts = env.eval_prompts()
    demos = {r["prompt"]: r["demonstration"] for r in make_rows(60, 2)}
    assert all(s.correct for s in env.score(prompts, [demos[p.text] for p in prompts]))


def test_bad_flags_are_user_errors(tmp_path):
    with pytest.raises(UserError) as e:
        run(parse("arithmetic", str(tmp_path / "x.jsonl"), "--tasks", "add,divide", "--max-operand", "1",
                  "--split", "eval"))
    assert e.value.messages == [
        "make-dataset --tasks: unknown task divide; valid: add, subtract, multiply, two_step",
        "make-dataset --max-operand: must be >= 2, got 1",
        "make-dataset --split: arithmetic writes one file; the dataset env holds out env.options.eval_fraction of "
        "its rows (by a hash of the prompt)"]
    with pytest.raises(UserError, match="--rows: must be >= 1"):
        run(parse("arithmetic", str(tmp_path / "x.jsonl"), "--rows", "0"))
    assert not (tmp_path / "x.jsonl").exists()


def test_prepare_data_builds_the_config_dataset():
    assert SHIPPED["artifacts/data/arithmetic.jsonl"][0] == "arithmetic"
    assert recipe("artifacts/data/arithmetic.jsonl") == ["--rows", "4000", "--seed", "6"]
    assert recipe("artifacts/data/qa.jsonl")[-4:] == ["--tasks", "add,compare,sort", "--max-operand", "20"]
    assert "artifacts/data/arithmetic.jsonl" in SHIPPED


@pytest.mark.usefixtures("restore_environ")  # main() runs in this process
def test_the_command_line(tmp_path, capsys):
    from xrlhf.cli import main

    out = tmp_path / "a.jsonl"
    assert main(["make-dataset", "arithmetic", str(out), "--rows", "5", "--seed", "1"]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == make_rows(5, 1)
    assert main(["make-dataset", "arithmetic", str(out), "--tasks", "divide"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: make-dataset --tasks: unknown task divide; valid: add, subtract, multiply, two_step"
