"""``benchmarks/recovery/chaos.py`` without runs: how it finds a moment in a run's log and files, tells
whether a kill landed in it, reads where a resume went on from and what the steps trained on
(the runs themselves: tests/e2e/test_chaos.py)."""

from __future__ import annotations

import json
import random
from collections import Counter

from benchmarks.recovery.chaos import Watch, aim, landed, resumed_from, trained, window

T = "2026-11-28 19:42:{:06.3f} | DEBUG    | xrlhf.x:f:1 - "


def log(path, *lines: tuple[float, str]) -> None:
    with open(path / "train.log", "a") as f:
        f.writelines(T.format(t) + text + "\n" for t, text in lines)


def test_a_moment_opens_at_its_nth_line_and_a_kill_lands_before_its_end(tmp_path):
    m = aim("update", steps=8, every=2, warmup=0, rng=random.Random(0))
    assert 3 <= m.nth <= 7 and m.where == f"step {m.nth}'s update"
    w = Watch(tmp_path)
    for s in range(1, m.nth + 1):
        log(tmp_path, (5 * s, "trainer: update begins"), (5 * s + 1, "trainer: train begins"))
        if s < m.nth:
            log(tmp_path, (5 * s + 2.5, "trainer: wait begins"))
    end = T.format(5 * m.nth + 3) + "trainer: sync begins\n"
    with open(tmp_path / "train.log", "a") as f:
        f.write(end[:30])  # a line being written is not read yet
    w.poll()
    assert w.find(m.start, m.nth) == len(w.lines) - 2 and w.lines[-1].endswith("trainer: train begins")
    assert landed(w, m)  # killed in step nth's update
    with open(tmp_path / "train.log", "a") as f:
        f.write(end[30:])
    assert not landed(w, m)  # its update was over
    ref = Watch(tmp_path)
    ref.poll()
    assert abs(window(ref, aim("update", 8, 2, 0, random.Random(0))) - 3.0) < 1e-6


def test_a_checkpoint_moment_is_its_temporary_directory(tmp_path):
    m = aim("checkpoint", steps=8, every=2, warmup=0, rng=random.Random(1))
    assert m.tmp in {"step-00000002", "step-00000004", "step-00000006"}
    w = Watch(tmp_path)
    (tmp_path / "checkpoints" / f".tmp-{m.tmp}-123").mkdir(parents=True)
    assert landed(w, m)
    (tmp_path / "checkpoints" / f".tmp-{m.tmp}-123").rename(tmp_path / "checkpoints" / m.tmp)
    assert not landed(w, m)
    assert w.tmp_of(m.tmp) == [f".tmp-{m.tmp}-123"]  # seen while it existed


def test_where_a_resume_went_on_from_and_what_the_steps_trained_on(tmp_path):
    assert resumed_from(["x", "INFO | resuming from /r/checkpoints/step-00000004 (step 4)"]) == "step-00000004"
    assert resumed_from(["warm-up: 30 SFT steps, continuing after step 12 (warmup-00000012)"]) == "warmup-00000012"
    assert resumed_from(["--resume: /r has no checkpoint (...); starting it from scratch"]) == "the start"
    rows = [{"step": 0, "eval/reward_mean": 0.1}, {"step": 1, "prompts": [0, 1]}, {"step": 2, "prompts": [2, 1]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "pro')
    assert trained(tmp_path) == ([1, 2], Counter({1: 2, 0: 1, 2: 1}))  # a torn last line is a crash's
