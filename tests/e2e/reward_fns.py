"""Reward functions named by import path in the tests (``tests.e2e.reward_fns:<name>``)."""

import math
import os
import time


def length_reward(prompts, responses):
    return [min(len(r), 4) / 4 for r in responses]


def nan_reward(prompts, responses):
    return [math.nan for _ in responses]


def flaky_reward(prompts, responses):
    """Raises on responses that contain a digit; scores the others 1."""
    out = []
    for r in responses:
        if any(c.isdigit() for c in r):
            raise ValueError(f"cannot score {r!r}")
        out.append(1.0)
    return out


def answer_reward(prompts, responses, answers):
    """1 where the response is the prompt's reference answer (a dataset env's ``answer``)."""
    return [float(r.strip() == a) for r, a in zip(responses, answers)]


def one_argument(responses):
    return [0.0 for _ in responses]


not_callable = [1.0, 2.0]


def string_reward(prompts, responses):
    return ["0.5" for _ in responses]


_calls = 0


def gated_length_reward(prompts, responses):
    """``length_reward``, but at each call number ``k`` of ``$XRLHF_TEST_GATE_CALLS`` ("2,3"; calls
    counted in this process from 1: one a step) it first writes ``$XRLHF_TEST_GATE.<k>.held`` and
    waits while the file ``$XRLHF_TEST_GATE.<k>`` exists: a test acts on a run (removes a node)
    at a known point of a known step."""
    global _calls
    _calls += 1
    gate = os.environ.get("XRLHF_TEST_GATE")
    if gate and str(_calls) in os.environ.get("XRLHF_TEST_GATE_CALLS", "").split(","):
        with open(f"{gate}.{_calls}.held", "w") as f:
            f.write(str(_calls))
        while os.path.exists(f"{gate}.{_calls}"):
            time.sleep(0.05)
    return length_reward(prompts, responses)
