"""Reward functions named by import path in the tests (``tests.e2e.reward_fns:<name>``)."""

import math


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
