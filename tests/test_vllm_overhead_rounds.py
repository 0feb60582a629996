"""``benchmarks.generation overhead``'s engines generating together: each round's wall time spans the first
engine's start to the last one's end, and the median round is reported (no vLLM needed)."""

from __future__ import annotations

from benchmarks.generation import RUNS, rounds_together


def test_each_round_spans_all_engines_and_the_median_is_kept():
    def gen(start: float, end: float) -> dict:
        return {"start": start, "end": end, "tokens": 100}

    # two engines, three rounds; engine 1 starts a little late and ends last in round 0
    e0 = {RUNS[0]: [gen(0, 2), gen(10, 13), gen(20, 21)], RUNS[1]: [gen(5, 6), gen(15, 16), gen(25, 27)]}
    e1 = {RUNS[0]: [gen(0.5, 3), gen(10, 12), gen(20, 22)], RUNS[1]: [gen(5, 7), gen(15, 15.5), gen(25, 26)]}
    out = rounds_together([e0, e1])
    assert out[RUNS[0]]["rounds_s"] == [3.0, 3.0, 2.0] and out[RUNS[0]]["seconds"] == 3.0
    assert out[RUNS[1]]["rounds_s"] == [2.0, 1.0, 2.0] and out[RUNS[1]]["seconds"] == 2.0
    assert out[RUNS[0]]["tokens_per_s"] == round(200 / 3.0)  # both engines' tokens over the median round
