"""``xrlhf make-completions``: a model's completions of an env's training prompts, seeded, as the
``{prompt, completion}`` rows ``algorithm.offline_dataset`` reads; bad input is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import yaml

from xrlhf.cli import main
from xrlhf.data.datasets import COMPLETIONS, load_rows
from xrlhf.envs import build_env

pytestmark = pytest.mark.usefixtures("restore_environ")  # main() runs in this process


def test_completions_are_seeded_rows_of_the_env_prompts(tiny_model, tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"env": {"name": "reasoning"}, "algorithm": {"name": "grpo"},
                                      "trainer": {"samples_per_prompt": 2},
                                      "policy": {"model": tiny_model, "generate": {"max_new_tokens": 4}}}))
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["make-completions", str(config), tiny_model, str(out_a), "--count", "5"]) == 0
    assert main(["make-completions", str(config), tiny_model, str(out_b), "--count", "5"]) == 0
    assert out_a.read_text() == out_b.read_text()
    rows = load_rows(out_a, COMPLETIONS)
    assert [rows[i]["prompt"] for i in range(5)] == [p.text for p in build_env("reasoning", {}, 0).train_prompts(0, 5)]
    assert all(len(r["completion"]) <= 4 for r in map(json.loads, out_a.read_text().splitlines()))


def test_a_missing_model_is_one_line(tiny_model, tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"env": {"name": "reasoning"}, "algorithm": {"name": "grpo"},
                                      "trainer": {"samples_per_prompt": 2}, "policy": {"model": tiny_model}}))
    assert main(["make-completions", str(config), str(tmp_path / "nope"), str(tmp_path / "o.jsonl")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: model: no such model directory")
