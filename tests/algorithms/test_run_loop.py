"""``run_loop``, every trainer's outer loop, as a function of the trainer: its order of calls,
``close()`` however it ends, the evaluator's summary, the stop after a step. The real trainers
run through it in tests/algorithms/test_one_path.py, test_distill.py and the e2e runs; here a
trainer of plain attributes records what the loop asks of it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from xrlhf.algorithms.base import run_loop
from xrlhf.algorithms.run import RunSpec
from xrlhf.utils.bounded import UserCodeAborted
from xrlhf.utils.run_hooks import RunHooks
from xrlhf.utils.timeline import Timeline


class Recorder:
    """The attributes ``run_loop`` reads of a trainer; each call is appended to ``calls``."""

    def __init__(self, steps: int, fail_at: int | None = None, stop_after: int | None = None, summary=None):
        self.calls: list[str] = []
        self.rows: list[dict] = []
        self.run = RunSpec(seed=0, steps=steps, eval_every=0, max_bad_steps=1, memory_timeline=False,
                           policy_dropout=0.0, algorithm="grpo")
        self.initial_eval, self.step_idx, self.fail_at = None, 0, fail_at
        self.hooks = RunHooks(log=self.rows.append, step_end=lambda s: s == stop_after)
        self.timeline = Timeline()
        self.throughput = SimpleNamespace(metrics=lambda m: {})
        self.evaluator = SimpleNamespace(summary=summary) if summary else SimpleNamespace()

    def evaluate(self):
        self.calls.append("evaluate")
        return {"eval/reward_mean": 0.5 + 0.1 * self.step_idx}

    def step(self):
        s = self.step_idx + 1
        self.calls.append(f"step {s}")
        if s == self.fail_at:
            raise UserCodeAborted("a reward function held up")
        return {"loss": float(s)}

    def take_memory(self):
        return {}

    def evaluates_after(self, step):
        return False

    def progress_line(self, step, metrics):
        return f"step {step}"

    def close(self):
        self.calls.append("close")


def test_the_loop_evaluates_runs_every_step_evaluates_and_closes():
    t = Recorder(steps=3)
    result = run_loop(t)
    assert t.calls == ["evaluate", "step 1", "step 2", "step 3", "evaluate", "close"]
    assert [r["step"] for r in t.rows] == [0, 1, 2, 3, 3]
    assert result["eval_reward_initial"] == pytest.approx(0.5) and result["eval_reward_final"] == pytest.approx(0.8)
    assert result["steps"] == 3 and "summary" not in result


def test_a_resumed_trainer_starts_after_its_last_step_without_the_first_evaluation():
    t = Recorder(steps=3)
    t.step_idx, t.initial_eval = 2, {"eval/reward_mean": 0.1}
    run_loop(t)
    assert t.calls == ["step 3", "evaluate", "close"]


def test_the_evaluators_summary_is_added_to_the_result():
    t = Recorder(steps=1, summary=lambda result: {"accuracy": result["eval_reward_final"]})
    assert run_loop(t)["summary"] == {"accuracy": pytest.approx(0.6)}


def test_a_step_end_that_asks_to_stop_ends_the_loop_with_none_and_closes():
    t = Recorder(steps=5, stop_after=2)
    assert run_loop(t) is None
    assert t.calls == ["evaluate", "step 1", "step 2", "close"] and t.step_idx == 2


def test_held_up_user_code_ends_the_loop_with_none_after_the_last_step_done_and_closes():
    t = Recorder(steps=5, fail_at=3)
    assert run_loop(t) is None
    assert t.calls[-2:] == ["step 3", "close"] and t.step_idx == 2


def test_any_other_error_propagates_and_still_closes():
    t = Recorder(steps=2)
    t.step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        run_loop(t)
    assert t.calls == ["evaluate", "close"]
