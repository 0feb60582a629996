"""Advantage estimators: hand-computed cases, naive reference loops, and the registry."""

import math
import sys
from pathlib import Path

import pytest
import torch

from xrlhf.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo,
    group_ids_for,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
T = torch.tensor


def some_fn(scores, mask, group_ids, *, gamma=1.0, token_rewards=None, eps=1e-6):
    """A user estimator reached by import path: every masked token gets its row's score."""
    return scores.unsqueeze(1) * mask


# --- naive reference loops (lists of floats, one group at a time) ----------------------------


def _groups(group_ids):
    groups = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups.values()


def ref_grpo(scores, group_ids, eps):
    out = [0.0] * len(scores)
    for rows in _groups(group_ids):
        n = len(rows)
        if n == 1:
            continue
        mean = sum(scores[i] for i in rows) / n
        std = math.sqrt(sum((scores[i] - mean) ** 2 for i in rows) / (n - 1))
        for i in rows:
            out[i] = (scores[i] - mean) / (std + eps)
    return out


def ref_dr_grpo(scores, group_ids, eps):
    out = [0.0] * len(scores)
    for rows in _groups(group_ids):
        mean = sum(scores[i] for i in rows) / len(rows)
        for i in rows:
            out[i] = scores[i] - mean
    return out


def ref_rloo(scores, group_ids, eps):
    out = [0.0] * len(scores)
    for rows in _groups(group_ids):
        if len(rows) == 1:
            continue
        for i in rows:
            others = [scores[j] for j in rows if j != i]
            out[i] = scores[i] - sum(others) / len(others)
    return out


def ref_reinforce_pp(row_rewards, mask, gamma):
    """row_rewards: per-row lists of per-token rewards; returns per-row lists of advantages."""
    returns = []
    for rewards, m in zip(row_rewards, mask):
        g, row = 0.0, [0.0] * len(m)
        for t in reversed(range(len(m))):
            if m[t]:
                g = rewards[t] + gamma * g
                row[t] = g
        returns.append(row)
    real = [returns[b][t] for b in range(len(mask)) for t in range(len(mask[b])) if mask[b][t]]
    mean = sum(real) / len(real)
    var = sum((x - mean) ** 2 for x in real) / len(real)
    return [[(returns[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b][t] else 0.0
             for t in range(len(mask[b]))] for b in range(len(mask))]


def last_token_rewards(scores, mask):
    rows = []
    for s, m in zip(scores, mask):
        last = max(t for t in range(len(m)) if m[t])
        rows.append([s if t == last else 0.0 for t in range(len(m))])
    return rows


def _random_batch(seed):
    """Groups of sizes 1..4, ids shuffled (non-contiguous), responses of length 1..6."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 3]
    group_ids = torch.cat([torch.full((n,), 10 * g + 7) for g, n in enumerate(sizes)])
    group_ids = group_ids[torch.randperm(len(group_ids), generator=gen)]
    B, R = len(group_ids), 6
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    scores[:3] = torch.round(scores[:3])  # some ties
    lengths = torch.randint(1, R + 1, (B,), generator=gen)
    mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).double()
    return scores, mask, group_ids


def _broadcast(per_row, mask):
    return torch.tensor([[a * m for m in row] for a, row in zip(per_row, mask.tolist())],
                        dtype=torch.float64)


# --- hand-computed cases ---------------------------------------------------------------------


def test_group_ids_for():
    assert group_ids_for(2, 3).tolist() == [0, 0, 0, 1, 1, 1]


def test_grpo_hand_computed():
    scores = T([1.0, 0.0, 0.0, 5.0])
    group_ids = T([0, 0, 0, 1])
    mask = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    # group 0 = {1, 0, 0}: mean 1/3; unbiased var = ((2/3)^2 + 2*(1/3)^2) / 2 = (4/9 + 2/9) / 2
    #   = 1/3; std = 0.577350. advantages: (2/3)/0.577350 = 1.154701, (-1/3)/0.577350 = -0.577350
    # group 1 = {5}: size 1 -> 0
    adv = grpo(scores, mask, group_ids, eps=0.0)
    expected = T([[1.154701, 1.154701], [-0.577350, 0.0], [-0.577350, -0.577350], [0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_grpo_all_equal_group_is_zero():
    adv = grpo(T([2.0, 2.0]), torch.ones(2, 3), T([0, 0]))
    assert torch.equal(adv, torch.zeros(2, 3))


def test_rloo_hand_computed():
    scores = T([1.0, 0.0, 3.0, 2.0, 4.0])
    group_ids = T([0, 0, 0, 1, 2])
    mask = T([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    # group 0 = {1, 0, 3}: 1 - (0 + 3)/2 = -0.5; 0 - (1 + 3)/2 = -2; 3 - (1 + 0)/2 = 2.5
    # groups 1 and 2 have one sample each -> 0
    adv = rloo(scores, mask, group_ids)
    expected = T([[-0.5, -0.5], [-2.0, -2.0], [2.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(adv, expected)


def test_dr_grpo_hand_computed():
    # group {1, 0, 3}: mean 4/3 -> [-1/3, -4/3, 5/3]
    adv = dr_grpo(T([1.0, 0.0, 3.0]), torch.ones(3, 1), T([0, 0, 0]))
    assert torch.allclose(adv, T([[-1 / 3], [-4 / 3], [5 / 3]]))


def test_reinforce_pp_hand_computed():
    scores = T([1.0, -1.0])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    # gamma 0.5, score on the last real token: row 0 returns [0.5, 1]; row 1 [-1, pad]
    # tokens {0.5, 1, -1}: mean 1/6; biased var = ((1/3)^2 + (5/6)^2 + (7/6)^2) / 3
    #   = (4/36 + 25/36 + 49/36) / 3 = (78/36) / 3 = 0.722222; std = 0.849837
    # whitened: (1/3)/0.849837 = 0.392232; (5/6)/0.849837 = 0.980581; (-7/6)/0.849837 = -1.372813
    adv = reinforce_pp(scores, mask, T([0, 1]), gamma=0.5)
    assert torch.allclose(adv, T([[0.392232, 0.980581], [-1.372813, 0.0]]), atol=1e-5)


# --- reference loops on random batches -------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,reference", [("grpo", ref_grpo), ("dr_grpo", ref_dr_grpo),
                                            ("rloo", ref_rloo)])
def test_group_estimators_match_reference_loop(name, reference, seed):
    scores, mask, group_ids = _random_batch(seed)
    adv = ADVANTAGE_ESTIMATORS.get(name)(scores, mask, group_ids, eps=1e-6)
    expected = _broadcast(reference(scores.tolist(), group_ids.tolist(), 1e-6), mask)
    assert torch.allclose(adv, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference_loop(seed, gamma):
    scores, mask, group_ids = _random_batch(seed)
    mask_l = mask.tolist()
    expected = ref_reinforce_pp(last_token_rewards(scores.tolist(), mask_l), mask_l, gamma)
    adv = reinforce_pp(scores, mask, group_ids, gamma=gamma)
    assert torch.allclose(adv, T(expected, dtype=torch.float64))

    # with per-token rewards (a KL penalty plus the score on the last token)
    kl = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    token_rewards = -0.1 * kl * mask + T(last_token_rewards(scores.tolist(), mask_l),
                                         dtype=torch.float64)
    expected = ref_reinforce_pp(token_rewards.tolist(), mask_l, gamma)
    adv = reinforce_pp(scores, mask, group_ids, gamma=gamma, token_rewards=token_rewards)
    assert torch.allclose(adv, T(expected, dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_baseline_matches_reference_loop(seed, gamma):
    scores, mask, group_ids = _random_batch(seed)
    mask_l = mask.tolist()
    baselined = ref_dr_grpo(scores.tolist(), group_ids.tolist(), 0.0)  # score - group mean
    expected = ref_reinforce_pp(last_token_rewards(baselined, mask_l), mask_l, gamma)
    adv = reinforce_pp_baseline(scores, mask, group_ids, gamma=gamma)
    assert torch.allclose(adv, T(expected, dtype=torch.float64))

    # token_rewards already holding the raw score: the group mean comes off the last token
    kl = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    penalty = (-0.1 * kl * mask).tolist()
    raw = [[p + r for p, r in zip(prow, rrow)]
           for prow, rrow in zip(penalty, last_token_rewards(scores.tolist(), mask_l))]
    want = [[p + r for p, r in zip(prow, rrow)]
            for prow, rrow in zip(penalty, last_token_rewards(baselined, mask_l))]
    adv = reinforce_pp_baseline(scores, mask, group_ids, gamma=gamma,
                                token_rewards=T(raw, dtype=torch.float64))
    assert torch.allclose(adv, T(ref_reinforce_pp(want, mask_l, gamma), dtype=torch.float64))


def test_padding_positions_are_zero_for_every_estimator():
    scores, mask, group_ids = _random_batch(3)
    for name in ADVANTAGE_ESTIMATORS.names():
        adv = ADVANTAGE_ESTIMATORS.get(name)(scores, mask, group_ids)
        assert adv.shape == mask.shape, name
        assert torch.all(adv[mask == 0] == 0), name


# --- registry --------------------------------------------------------------------------------


def test_builtin_names_registered():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(
        ADVANTAGE_ESTIMATORS.names())


def test_register_custom_estimator_and_duplicate_raises(monkeypatch):
    # a private copy of the table, restored after the test, so "my_est" does not leak
    monkeypatch.setattr(ADVANTAGE_ESTIMATORS, "_items", dict(ADVANTAGE_ESTIMATORS._items))

    @ADVANTAGE_ESTIMATORS.register("my_est")
    def my_est(scores, mask, group_ids, *, gamma=1.0, token_rewards=None, eps=1e-6):
        return torch.zeros_like(mask)

    assert ADVANTAGE_ESTIMATORS.get("my_est") is my_est
    with pytest.raises(ValueError, match="my_est"):
        ADVANTAGE_ESTIMATORS.register("my_est")(some_fn)
    with pytest.raises(ValueError, match="grpo"):
        ADVANTAGE_ESTIMATORS.register("grpo")(some_fn)


def test_unknown_name_lists_valid_ones():
    with pytest.raises(KeyError, match="rloo"):
        ADVANTAGE_ESTIMATORS.get("nope")


def test_get_by_import_path(monkeypatch):
    assert ADVANTAGE_ESTIMATORS.get("xrlhf.algorithms.estimators:rloo") is rloo
    # tests/ has no __init__.py: pytest imports this file as a top-level module, so the
    # dotted path "tests.algorithms.test_estimators" resolves only with the repository root
    # on sys.path (then "tests" is a namespace package and the file is imported once more
    # under that name).
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    before = set(sys.modules)
    try:
        fn = ADVANTAGE_ESTIMATORS.get("tests.algorithms.test_estimators:some_fn")
    finally:  # drop the second copy so no other test sees a stray "tests" package
        for name in set(sys.modules) - before:
            if name == "tests" or name.startswith("tests."):
                del sys.modules[name]
    assert fn.__module__ == "tests.algorithms.test_estimators" and fn.__name__ == "some_fn"
    mask = T([[1.0, 0.0]])
    assert torch.equal(fn(T([3.0]), mask, T([0])), T([[3.0, 0.0]]))
