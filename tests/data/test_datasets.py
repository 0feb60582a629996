"""Row datasets: JSONL and parquet through ``datasets``; a bad row names the file and line."""

import json

import pytest

from xrlhf.validation import validate_dict
from xrlhf.data.datasets import (KTO, PREFERENCE, PROMPTS, EpochOrder, held_out, load_rows, split_held_out,
                                 write_jsonl)
from xrlhf.utils.errors import UserError

PAIR = {"prompt": "2+3=", "chosen": "5", "rejected": "6"}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_rows_load_and_extra_fields_are_ignored(tmp_path):
    path = write_jsonl([PAIR, {**PAIR, "prompt": "1+1=", "source": "hand"}], tmp_path / "p.jsonl")
    rows = load_rows(path, PREFERENCE)
    assert len(rows) == 2 and rows[1] == {"prompt": "1+1=", "chosen": "5", "rejected": "6"}
    assert rows.where(1) == f"{path}:2"


def test_parquet_rows_load(tmp_path):
    import pandas as pd

    path = tmp_path / "k.parquet"
    pd.DataFrame({"prompt": ["a", "b"], "completion": ["x", "y"], "label": [True, False]}).to_parquet(path)
    rows = load_rows(path, KTO)
    assert [r["label"] for r in rows.rows] == [True, False]
    assert rows.where(1) == f"{path}: row 1"


def test_missing_field_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(PAIR), json.dumps(PAIR),
                                              json.dumps({"prompt": "x", "chosen": "y"})])
    with pytest.raises(UserError) as e:
        load_rows(path, PREFERENCE)
    assert e.value.messages == [f"{path}:3: missing field 'rejected' (a preferences row needs prompt, chosen, "
                                f"rejected: {json.dumps(PAIR)})"]


def test_trailing_blank_lines_are_fine_but_line_numbers_count_blank_lines_before(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(PAIR), json.dumps({**PAIR, "chosen": 7}), "", ""])
    with pytest.raises(UserError, match=r"p.jsonl:2: field 'chosen' must be a string, got 7"):
        load_rows(path, PREFERENCE)
    ok = write_lines(tmp_path / "ok.jsonl", [json.dumps(PAIR), "", ""])
    assert len(load_rows(ok, PREFERENCE)) == 1


def test_blank_line_between_rows_is_named(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(PAIR), "", json.dumps(PAIR)])
    with pytest.raises(UserError, match=r"p.jsonl:2: blank line between rows"):
        load_rows(path, PREFERENCE)


def test_malformed_json_line_is_named(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(PAIR), '{"prompt": "x", "chosen": "y"'])
    with pytest.raises(UserError, match=r"p.jsonl:2: not valid JSON"):
        load_rows(path, PREFERENCE)
    path = write_lines(tmp_path / "q.jsonl", ['["a list"]'])
    with pytest.raises(UserError, match=r"q.jsonl:1: a row must be a JSON object"):
        load_rows(path, PREFERENCE)


def test_kto_label_accepts_bools_and_0_1_only(tmp_path):
    good = write_jsonl([{"prompt": "a", "completion": "b", "label": 1}, {"prompt": "a", "completion": "c",
                                                                         "label": False}], tmp_path / "k.jsonl")
    assert [r["label"] for r in load_rows(good, KTO).rows] == [True, False]
    bad = write_jsonl([{"prompt": "a", "completion": "b", "label": True},
                       {"prompt": "a", "completion": "b", "label": "yes"}], tmp_path / "bad.jsonl")
    with pytest.raises(UserError, match=r"bad.jsonl:2: field 'label' must be true or false"):
        load_rows(bad, KTO)


def test_parquet_null_is_named_by_row(tmp_path):
    import pandas as pd

    path = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": ["a", None], "chosen": ["b", "c"], "rejected": ["d", "e"]}).to_parquet(path)
    with pytest.raises(UserError, match=r"p.parquet: row 1: missing field 'prompt'"):
        load_rows(path, PREFERENCE)


def test_optional_answer_and_empty_file(tmp_path):
    path = write_jsonl([{"prompt": "a", "answer": "b"}, {"prompt": "c"}], tmp_path / "q.jsonl")
    assert [r["answer"] for r in load_rows(path, PROMPTS).rows] == ["b", None]
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match=r"e.jsonl: no rows"):
        load_rows(empty, PROMPTS)
    with pytest.raises(UserError, match=r"x.csv: a dataset must be a .jsonl, .json or .parquet file"):
        load_rows(tmp_path / "x.csv", PROMPTS)


def test_held_out_is_a_function_of_the_text():
    texts = [f"{a}+{b}=" for a in range(30) for b in range(30)]
    out = [t for t in texts if held_out(t, 0.1)]
    assert 0.05 < len(out) / len(texts) < 0.15
    assert out == [t for t in texts if held_out(t, 0.1)]
    assert not any(held_out(t, 0.0) for t in texts)


def test_dataset_paths_are_checked_when_the_config_is_validated(tmp_path):
    """Missing files are config errors named by their YAML path, all reported together."""
    from xrlhf.models.tiny import build_model

    model = build_model(tmp_path / "m")
    with pytest.raises(UserError) as e:
        validate_dict({"env": {"name": "qa", "options": {"dataset": str(tmp_path / "nope.jsonl")}},
                       "policy": {"model": str(model)}, "reward": {"source": "model", "model": str(model)},
                       "algorithm": {"name": "dpo", "dataset": str(tmp_path / "missing.jsonl"), "bta": 1}})
    lines = e.value.messages
    assert any(line.startswith("env.options.dataset: no such file") for line in lines), lines
    assert any(line.startswith("algorithm.dataset: no such file") and "xrlhf make-dataset" in line
               for line in lines), lines
    assert any(line.startswith("algorithm.bta: unknown key") for line in lines), lines


def test_epoch_order_is_a_fresh_seeded_permutation_per_epoch():
    order = EpochOrder(5, seed=3, salt="t")
    first, second = order.take(0, 5), order.take(5, 5)
    assert sorted(first) == sorted(second) == list(range(5))
    assert order.take(3, 4) == first[3:] + second[:2]  # across the epoch boundary
    assert EpochOrder(5, seed=3, salt="t").take(0, 10) == first + second
    assert EpochOrder(5, seed=4, salt="t").take(0, 10) != first + second


def test_split_held_out_by_key_and_names_an_empty_side():
    keys = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    train, evals = split_held_out(list(range(100)), keys, 0.2, path="f.jsonl", section="algorithm", noun="pairs")
    assert set(train) | set(evals) == set(range(100)) and not set(train) & set(evals)
    assert evals == [i for i in range(100) if held_out(keys[i], 0.2)]
    kept = next(k for k in keys if not held_out(k, 0.2))
    with pytest.raises(UserError, match=r"f.jsonl: algorithm.eval_fraction 0.2 leaves 1 training and 0 held-out pairs"):
        split_held_out([0], [kept], 0.2, path="f.jsonl", section="algorithm", noun="pairs")
