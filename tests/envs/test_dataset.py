"""The ``dataset`` env (issue 51): rows from JSONL, parquet and a datasets directory; each bad row
one line naming the file and the row; the held-out split; the verifier's rewards; the chat
variant; and a short supervised warm-up + GRPO run of a tiny model in this process."""

from __future__ import annotations

import json
import re
import sys

import pytest
import yaml
from loguru import logger
from pydantic import ValidationError

from xrlhf.algorithms.build import build_trainer
from xrlhf.data.datasets import held_out, write_jsonl
from xrlhf.envs import ENVS, build_env
from xrlhf.envs.dataset import DatasetChatEnv, DatasetEnv, read_records
from xrlhf.envs.word_problems import TEMPLATES, make_rows
from xrlhf.utils.errors import UserError
from xrlhf.utils.run_hooks import RunHooks

ROWS = make_rows(200, seed=0)
DEMO = {r["prompt"]: r["demonstration"] for r in ROWS}


@pytest.fixture
def jsonl(tmp_path) -> str:
    return str(write_jsonl(ROWS, tmp_path / "arith.jsonl"))


def env_of(path, **options) -> DatasetEnv:
    return build_env("dataset", {"dataset": str(path), "verifier": "numeric", **options}, seed=0)


def test_registered():
    assert ENVS.get("dataset") is DatasetEnv and ENVS.get("dataset_chat") is DatasetChatEnv
    assert DatasetEnv.reward_source == "rule"


def test_jsonl_split_is_hashed_disjoint_and_the_stream_a_function_of_seed_and_index(jsonl):
    env = env_of(jsonl)
    evals = {p.text for p in env.eval_prompts()}
    train = {p.text for p in env.train_prompts(0, 600)}  # 3+ epochs visit every training row
    assert evals and not evals & train and evals | train == set(DEMO)
    assert evals == {t for t in DEMO if held_out(t, 0.1)}
    answers = {r["prompt"]: r["answer"] for r in ROWS}
    assert all(p.answer == answers[p.text] and p.task == "dataset" for p in env.train_prompts(0, 20))
    assert env.train_prompts(150, 100) == env_of(jsonl).train_prompts(150, 100)  # crosses an epoch boundary
    assert env.train_prompts(150, 100) == env.train_prompts(0, 250)[150:]
    assert [p.index for p in env.train_prompts(7, 3)] == [7, 8, 9]
    other = build_env("dataset", {"dataset": jsonl, "verifier": "numeric"}, seed=1)
    assert other.train_prompts(0, 10) != env.train_prompts(0, 10) and other.eval_prompts() == env.eval_prompts()
    assert len(env_of(jsonl, eval_size=3).eval_prompts()) == 3


def test_rewards_come_from_the_verifier(jsonl):
    env = env_of(jsonl, demonstration_column="demonstration", task_column="task")
    prompts = env.train_prompts(0, 8)
    right = env.score(prompts, [DEMO[p.text] + "</s>" for p in prompts])
    assert all(s.reward == 1.0 and s.correct for s in right)
    assert {s.info["task"] for s in right} == set(TEMPLATES)
    (wrong,) = env.score(prompts[:1], [f"The answer is {int(prompts[0].answer) + 1}"])
    assert wrong.reward == 0.0 and wrong.correct is False
    assert env.sft_examples(0, 8) == [(p.text, DEMO[p.text]) for p in prompts]  # worked answers
    exact = env_of(jsonl, verifier="exact")
    p = exact.train_prompts(0, 1)
    assert exact.sft_examples(0, 1) == [(p[0].text, p[0].answer)]  # no demonstration column: the answer
    assert [s.reward for s in exact.score(p * 2, [DEMO[p[0].text], f" {p[0].answer}. "])] == [0.0, 1.0]


def test_eval_dataset_is_left_out_of_training(tmp_path, jsonl):
    held = write_jsonl(ROWS[:5], tmp_path / "held.jsonl")
    lines = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        env = env_of(jsonl, eval_dataset=str(held), eval_size=3)
        evals = env.eval_prompts()
    finally:
        logger.remove(sink)
    assert [p.text for p in evals] == [r["prompt"] for r in ROWS[:3]]
    assert not {r["prompt"] for r in ROWS[:5]} & {p.text for p in env.train_prompts(0, 600)}
    assert any("5 training rows" in line and "left out of training" in line for line in lines)


@pytest.mark.parametrize("line, problem", [
    ('{"answer": "5"}', "missing column 'prompt'; a row looks like {\"prompt\": \"What is 2 + 3?\", \"answer\": \"5\"} "
                        "(env.options.prompt_column names another column)"),
    ('{"prompt": 12, "answer": "5"}', "column 'prompt' must be a string, got 12 (type int)"),
    ('{"prompt": "  ", "answer": "5"}', "column 'prompt' is empty"),
    ('{"prompt": "q", "answer": " "}', "column 'answer' is empty; every row needs its reference answer"),
    ('{"prompt": "q", "answer": null}', "missing column 'answer'"),
    ('{"prompt": "q", "answer": [5]}', "column 'answer' must be a string or a number, got [5] (type list)"),
    ('{"prompt": "q", "answer": "five"}', "answer 'five' has no number to compare with (verifier 'numeric')"),
    ('{"prompt": "q", "answer": "5"', "not valid JSON (Expecting ',' delimiter, column 30); each line must be one "
                                      "JSON object"),
    ('["q", "5"]', "a row must be an object like"),
])
def test_a_bad_jsonl_row_is_one_line_naming_the_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "What is 2 + 3?", "answer": 5})  # a number is read as its text
    path.write_text(f"{good}\n{good}\n\n{line}\n{good}\n")  # the blank line 3 is skipped, still counted
    with pytest.raises(UserError) as e:
        env_of(path).eval_prompts()
    (message,) = e.value.messages
    assert message.startswith(f"env.options.dataset: {path}:4: {problem}")


def test_every_bad_row_is_reported_up_to_ten_then_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(13)))
    with pytest.raises(UserError) as e:
        env_of(path).eval_prompts()
    assert len(e.value.messages) == 11
    assert e.value.messages[9].startswith(f"env.options.dataset: {path}:10: missing column 'answer'")
    assert e.value.messages[10] == f"env.options.dataset: {path}: ... and 3 more bad rows"


def test_other_columns_by_option(tmp_path):
    path = write_jsonl([{"question": f"{i} + 1?", "solution": f"It is {i + 1}", "label": i + 1} for i in range(40)],
                       tmp_path / "q.jsonl")
    env = env_of(path, prompt_column="question", answer_column="label", demonstration_column="solution",
                 eval_fraction=0.2)
    prompt, target = env.sft_examples(0, 1)[0]
    assert target == f"It is {int(prompt.split(' ')[0]) + 1}"
    assert all(env.score([p], [f"= {p.answer}"])[0].correct for p in env.eval_prompts())


def test_a_missing_or_foreign_file_is_one_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValidationError, match=rf"no such file '{missing}' \(write an arithmetic one with: xrlhf "
                                              rf"make-dataset arithmetic {missing}\)"):
        env_of(missing)
    with pytest.raises(ValidationError, match=r"a dataset is a .jsonl or .parquet file, or a directory"):
        env_of(tmp_path / "rows.csv")
    with pytest.raises(UserError, match=rf"^{missing}: no such file or directory$"):
        read_records(str(missing))


def test_options_are_checked_before_any_row_is_read(jsonl, tmp_path):
    def errors(**options) -> str:
        with pytest.raises(ValidationError) as e:
            env_of(jsonl, **options)
        return str(e.value)

    assert "eval_fraction: 0 holds no prompts out" in errors(eval_fraction=0)
    assert "env.options.split: " in errors(split="train") and "only a directory written by" in errors(split="x")
    assert "unknown verifier 'regex'; valid: boxed, exact, numeric" in errors(verifier="regex")
    assert "unknown key 'tol' (valid for verifier 'numeric': rel_tol, abs_tol)" in errors(verifier_options={"tol": 1})
    assert "Extra inputs are not permitted" in errors(colum="x")


def test_parquet_reads_as_jsonl(tmp_path, jsonl):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "arith.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "answer": int(r["answer"])} for r in ROWS]), path)  # int answers
    env, ref = env_of(path), env_of(jsonl)
    assert env.eval_prompts() == ref.eval_prompts() and env.train_prompts(0, 50) == ref.train_prompts(0, 50)


def test_a_bad_parquet_row_is_named_by_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": ""}]), path)
    with pytest.raises(UserError) as e:
        env_of(path).eval_prompts()
    assert e.value.messages == [f"env.options.dataset: {path}: row 1: column 'answer' is empty; every row needs "
                                f"its reference answer"]


def test_parquet_without_pyarrow_or_pandas_names_the_package(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "arith.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    for name in ("pyarrow", "pyarrow.parquet", "pandas"):
        monkeypatch.setitem(sys.modules, name, None)  # the import then fails, as if not installed
    with pytest.raises(UserError) as e:
        env_of(path).eval_prompts()
    (message,) = e.value.messages
    assert message.startswith(f"env.options.dataset: {path}: reading parquet needs the pyarrow package")
    assert message.endswith("install it with: pip install pyarrow")


def test_a_datasets_directory_and_its_splits(tmp_path, jsonl):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    plain = tmp_path / "plain"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(plain))
    ref = env_of(jsonl)
    assert env_of(plain).eval_prompts() == ref.eval_prompts()
    assert env_of(plain).train_prompts(0, 30) == ref.train_prompts(0, 30)

    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:150]),
                          "test": datasets.Dataset.from_list(ROWS[150:])}).save_to_disk(str(both))
    env = env_of(both, eval_split="test")
    assert [p.text for p in env.eval_prompts()] == [r["prompt"] for r in ROWS[150:]]
    assert {p.text for p in env.train_prompts(0, 300)} == {r["prompt"] for r in ROWS[:150]}
    with pytest.raises(UserError, match=r"no split 'dev' \(its splits: train, test\); choose one with "
                                        r"env.options.split"):
        env_of(both, split="dev").eval_prompts()
    with pytest.raises(UserError, match=r"a Dataset without splits; remove env.options.eval_split"):
        env_of(plain, eval_split="test").eval_prompts()

    bad = tmp_path / "bad"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "1+1?", "answer": "two"}])}
                         ).save_to_disk(str(bad))
    with pytest.raises(UserError) as e:
        env_of(bad).eval_prompts()
    assert e.value.messages == [f"env.options.dataset: {bad} [train]: row 0: answer 'two' has no number to compare "
                                f"with (verifier 'numeric')"]


def test_a_datasets_directory_without_datasets_names_the_package(tmp_path, monkeypatch):
    (tmp_path / "saved").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError) as e:
        env_of(tmp_path / "saved").eval_prompts()
    assert e.value.messages == [f"env.options.dataset: {tmp_path / 'saved'}: reading a directory written by "
                                f"save_to_disk needs the datasets package, which is not installed; install it "
                                f"with: pip install datasets"]


def test_a_user_verifier_by_import_path(tmp_path, monkeypatch, jsonl):
    (tmp_path / "my_dataset_verifier.py").write_text(
        "def half(completion: str, answer: str) -> float:\n"
        "    return 1.0 if completion.endswith(answer) else 0.5 if answer in completion else 0.0\n"
        "def text(completion, answer):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = build_env("dataset", {"dataset": jsonl, "verifier": "my_dataset_verifier:half"}, 0)
    p = env.train_prompts(0, 1)[0]
    scores = env.score([p, p, p], [f"= {p.answer}", f"{p.answer} apples", "nothing"])
    assert [(s.reward, s.correct) for s in scores] == [(1.0, True), (0.5, False), (0.0, False)]
    bad = build_env("dataset", {"dataset": jsonl, "verifier": "my_dataset_verifier:text"}, 0)
    with pytest.raises(TypeError, match=r"verifier my_dataset_verifier:text returned 'yes' \(a str\); a verifier "
                                        r"returns a float"):
        bad.score([p], ["x"])
    with pytest.raises(ValidationError, match=r"env.options.verifier|verifier\n.*my_dataset_verifier:nope"):
        build_env("dataset", {"dataset": jsonl, "verifier": "my_dataset_verifier:nope"}, 0)


def test_the_docs_verifier_runs_as_written(tmp_path, monkeypatch, jsonl):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    code = re.search(r"```python\n# my_pkg/verify.py\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "docs_verify_pkg").mkdir()
    (tmp_path / "docs_verify_pkg" / "__init__.py").write_text("")
    (tmp_path / "docs_verify_pkg" / "verify.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "verifier: my_pkg.verify:last_word" in doc
    env = build_env("dataset", {"dataset": jsonl, "verifier": "docs_verify_pkg.verify:last_word"}, 0)
    p = env.train_prompts(0, 1)[0]
    assert [s.reward for s in env.score([p] * 3, [f"it is {p.answer}", f"{p.answer} it is", "no"])] == [1.0, 0.5, 0.0]


def test_chat_variant_renders_messages_with_the_template(jsonl, tiny_model):
    from xrlhf.data.text import encode_prompt, load_tokenizer

    env = build_env("dataset_chat", {"dataset": jsonl, "verifier": "numeric", "demonstration_column": "demonstration",
                                     "system_prompt": "Answer with a number."}, 0)
    p = env.train_prompts(0, 1)[0]
    assert p.messages == ({"role": "system", "content": "Answer with a number."}, {"role": "user", "content": p.text})
    tok = load_tokenizer(tiny_model)
    assert tok.decode(encode_prompt(tok, p)) == f"<s>S: Answer with a number.\nU: {p.text}\nA:\n"
    turn = env.start(p).step(DEMO[p.text])
    assert turn.done and turn.correct and turn.reward == 1.0
    assert env.score([p], ["no idea"])[0].correct is False
    assert env.sft_conversations(0, 1) == [[*p.messages, {"role": "assistant", "content": DEMO[p.text]}]]
    plain = build_env("dataset_chat", {"dataset": jsonl}, 0).eval_prompts()[0]
    assert plain.messages == ({"role": "user", "content": plain.text},)
    with pytest.raises(ValidationError, match="max_turns"):
        build_env("dataset_chat", {"dataset": jsonl, "max_turns": 2}, 0)


@pytest.mark.usefixtures("restore_environ")  # main() runs in this process
def test_cli_validate_names_the_bad_row_and_exits_2(tiny_model, tmp_path, capsys):
    from xrlhf.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n{"prompt": 5, "answer": "1"}\n')
    config = {"env": {"name": "dataset", "options": {"dataset": str(data), "eval_fraction": 0.5}},
              "policy": {"model": tiny_model, "generate": {"max_new_tokens": 8}},
              "algorithm": {"name": "grpo"}, "trainer": {"samples_per_prompt": 2}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    assert main(["validate", str(tmp_path / "cfg.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")][0].endswith(
        f"{data}:2: column 'prompt' must be a string, got 5 (type int)")


def test_a_short_warmup_and_grpo_run_on_cpu(tiny_model, jsonl, tmp_path):
    """The real path in one process: config validation, the warm-up on demonstrations, two GRPO
    steps sampled by the Transformers engine and rewarded by the verifier, then an evaluation."""
    from xrlhf.algorithms.local import LocalHandle, LocalHandles
    from xrlhf.algorithms.rewards import build_reward
    from xrlhf.algorithms.rollout.evaluate import evaluate
    from xrlhf.algorithms.warmup import supervised_warmup
    from xrlhf.data.text import load_tokenizer
    from xrlhf.engines.base import EngineSpec, SamplingParams
    from xrlhf.engines.hf import HFGenerateEngine, HFTrainEngine
    from xrlhf.validation import algorithm_options, validate_dict

    options = {"dataset": jsonl, "verifier": "numeric", "demonstration_column": "demonstration",
               "task_column": "task", "eval_size": 4}
    cfg = validate_dict({"env": {"name": "dataset", "options": options},
                         "policy": {"model": tiny_model, "train": {"lr": 1e-3}, "generate": {"max_new_tokens": 12}},
                         "warmup": {"steps": 2, "batch_size": 4},
                         "algorithm": {"name": "grpo", "mini_batch_size": 8, "kl_coef": 0.0}, "reference": None,
                         "trainer": {"steps": 2, "prompts_per_step": 4, "samples_per_prompt": 2, "eval_size": 4}})
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    tok = load_tokenizer(tiny_model)
    model, before = supervised_warmup(cfg, env, tok, tiny_model, tmp_path)
    assert 0.0 <= before["eval/reward_mean"] <= 1.0
    train = HFTrainEngine(EngineSpec(model, options={"lr": 1e-3, "micro_batch_size": 8}, seed=0))
    handles = LocalHandles(LocalHandle.of("policy", train=train, generate=HFGenerateEngine(EngineSpec(model, seed=0))))
    trainer = build_trainer(cfg, algorithm_options(cfg), handles, env, tok, build_reward(cfg, env, handles),
                            RunHooks())
    for _ in range(2):
        metrics = trainer.step()
    assert 0.0 <= metrics["reward/mean"] <= 1.0 and 0.0 <= metrics["reward/accuracy"] <= 1.0
    after = evaluate(handles.generator, env, tok, SamplingParams(temperature=0.0, max_new_tokens=12), limit=4)
    assert {"eval/reward_mean", "eval/accuracy"} <= set(after)
    assert {k for k in after if k.startswith("eval/reward_") and k != "eval/reward_mean"} <= \
        {f"eval/reward_{t}" for t in TEMPLATES}
