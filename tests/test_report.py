"""report.md from hand-made metrics: tidy numbers, an Episodes section with a truncation note,
sampled transcripts; the timeline's labels never overlap (the e2e runs check real reports)."""

from __future__ import annotations

import json
from itertools import combinations
from types import SimpleNamespace

import pytest

from xrlhf.data.text import load_tokenizer
from xrlhf.report import read_jsonl, tidy, timeline_figure, write_report, write_transcripts


@pytest.mark.parametrize("value,text", [(0.28515625, "0.2852"), (3, "3"), (2.0, "2"), (1234.5, "1234"),
                                        (123456.7, "123457"), (0.000123456, "0.0001235"), (True, "True"),
                                        ("final", "final"), (float("nan"), "nan")])
def test_tidy(value, text):
    assert tidy(value) == text


def crowded_rows() -> list[dict]:
    """Two steps whose bars are mostly too narrow for their names, parts over the trainer's update."""
    rows = []
    for s in (1, 2):
        t = 10.0 * (s - 1)
        spans = [["trainer", "update", t, t + 9], ["trainer", "infer", t, t + 0.3], ["trainer", "train", t + 0.3, t + 8.6],
                 ["trainer", "sync", t + 8.6, t + 9]]
        spans += [["generator", f"b{s}.{k}", t + 0.1 * k, t + 0.1 * k + 0.09] for k in range(60)]
        spans += [["reward", f"b{s}.{k}", t + 6.0 + 0.2 * k, t + 6.15 + 0.2 * k] for k in range(10)]
        rows.append({"step": s, "reward/mean": 0.5, "timeline": spans})
    return rows


def test_timeline_labels_fit_their_bars_and_never_overlap():
    fig = timeline_figure(crowded_rows())
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    texts = ax.texts
    boxes = [t.get_window_extent(renderer) for t in texts]
    assert [t.get_text() for t in texts].count("train") == 2  # the wide bars keep their labels
    assert "update" not in [t.get_text() for t in texts]  # under its labelled parts
    assert not any(a.overlaps(b) for a, b in combinations(boxes, 2))
    assert len(texts) < 10  # the 120 narrow generate and reward bars carry none
    keys = [t.get_text() for t in ax.get_legend().get_texts()]  # one key per colour, not per batch
    assert keys == ["update", "infer", "train", "sync", "generator (bN: batch N)", "reward (bN: batch N)"], keys


def test_episodes_section_transcripts_and_tidy_summary(tmp_path, tiny_model):
    rows = [{"step": 0, "eval/reward_mean": 0.125, "eval/turns_mean": 1.5, "eval/tool_calls_mean": 0.25},
            {"step": 1, "reward/mean": 0.1, "episode/turns_mean": 1.75, "episode/tool_calls_mean": 0.5,
             "episode/tool_timeouts_mean": 0.0, "episode/truncated_frac": 0.46875},
            {"step": 2, "reward/mean": 0.3, "episode/turns_mean": 2.0, "episode/tool_calls_mean": 0.875,
             "episode/tool_timeouts_mean": 0.0625, "episode/truncated_frac": 0.46875},
            {"step": 2, "eval/reward_mean": 0.28515625, "eval/turns_mean": 2.0, "eval/tool_calls_mean": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 2, "wall_seconds": 61.3, "eval_reward_initial": 0.125,
                                                       "eval_reward_final": 0.28515625}))
    tok = load_tokenizer(tiny_model)

    def trajectory(i: int, answer: str):
        return SimpleNamespace(prompt_ids=tok.encode(f"q{i}"), tokens=tok.encode(answer, add_special_tokens=False),
                               reward=float(i % 2), correct=bool(i % 2), truncated=False, turns=1,
                               counters={"tool_calls": 0.0})

    write_transcripts(tmp_path, 2, [trajectory(i, "old") for i in range(8)], tok, n=2)
    write_transcripts(tmp_path, 0, [trajectory(i, "first") for i in range(8)], tok, n=2)  # a resumed run: step 0 again
    write_transcripts(tmp_path, 2, [trajectory(i, "new") for i in range(8)], tok, n=2)
    records = read_jsonl(tmp_path / "transcripts.jsonl")
    assert [(r["step"], r["sample"]) for r in records] == [(0, 0), (0, 4), (2, 0), (2, 4)]
    assert all(r["episode"].endswith("new") for r in records if r["step"] == 2)
    report = write_report(tmp_path).read_text()
    assert "| eval_reward_final | 0.2852 |" in report and "| wall_seconds | 61.3 |" in report
    assert "| | step 1 | step 2 | eval, step 0 | eval, step 2 |" in report
    assert "| tool_calls_mean | 0.5 | 0.875 | 0.25 | 1 |" in report
    assert "| tool_timeouts_mean | 0 | 0.0625 | — | — |" in report
    assert "**47% of the last step's episodes were truncated**" in report
    assert "## Sampled transcripts (eval, step 2)" in report and "Sample 4: reward 0, wrong, 1 turn(s)" in report
    assert "![episodes](plots/episodes.png)" in report and (tmp_path / "plots" / "episodes.png").is_file()


def test_distillation_section_puts_student_and_teacher_side_by_side(tmp_path):
    teacher = {"eval/teacher_reward_mean": 0.5}
    rows = [{"step": 0, "eval/reward_mean": 0.125, **teacher},
            {"step": 1, "reward/mean": 0.1, "distill/reverse_kl": 2.5, "distill/reverse_kl_wrong": 2.5,
             "perf/teacher_tokens_per_s": 1000.0},
            {"step": 2, "reward/mean": 0.3, "distill/reverse_kl": 0.75, "distill/reverse_kl_right": 0.25,
             "distill/reverse_kl_wrong": 1.0, "perf/teacher_tokens_per_s": 3000.0},
            {"step": 2, "eval/reward_mean": 0.4375, **teacher}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(tmp_path).read_text()
    assert "| step | student eval reward | teacher eval reward | student / teacher |" in report
    assert "| 0 | 0.125 | 0.5 | 0.25 |" in report and "| 2 | 0.4375 | 0.5 | 0.875 |" in report
    assert "2.5 at step 1, 0.75 at step 2; right answers 0.25; wrong answers 1." in report
    assert "Teacher logprobs: 2000 response tokens/s" in report
    assert (tmp_path / "plots" / "distill.png").is_file()
    assert "Student and teacher" not in write_report_without_teacher(tmp_path)


def write_report_without_teacher(tmp_path) -> str:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.1}) + "\n")
    return write_report(tmp_path).read_text()
