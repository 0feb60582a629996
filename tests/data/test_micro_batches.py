"""The micro-batch plan: a row cap, a token budget, groups kept together, every row once."""

from __future__ import annotations

import random

import pytest
import torch

from xrlhf.data.batch import Batch
from xrlhf.data.micro_batches import in_row_order, plan_micro_batches


def test_without_a_budget_the_plan_is_the_consecutive_row_split():
    assert plan_micro_batches([5, 3, 8, 2, 7], max_rows=2) == [[0, 1], [2, 3], [4]]
    batch = Batch({"x": torch.arange(7)})
    assert [p["x"].tolist() for p in batch.chunks(3)] == plan_micro_batches([1] * 7, max_rows=3)


def test_budget_places_longest_first_into_the_least_filled_micro_batch():
    # total 25 tokens, budget 10, 2 rows each: K = max(ceil(25/10), ceil(5/2)) = 3 to start.
    # 8 -> A, 7 -> B, 5 -> C; 3 fits B (10) and C (8): C has fewer tokens; 2 fits A (10) and B
    # (9), C is full of rows: B has fewer. A = [2], B = [4, 3], C = [0, 1].
    assert plan_micro_batches([5, 3, 8, 2, 7], max_rows=2, max_tokens=10) == [[0, 1], [2], [3, 4]]


def test_budget_opens_micro_batches_as_needed_and_never_truncates():
    # 3 rows of 6 under a budget of 10: two fit nowhere together, so three micro-batches
    assert plan_micro_batches([6, 6, 6], max_rows=8, max_tokens=10) == [[0], [1], [2]]
    # a row longer than the budget gets a micro-batch of its own
    assert plan_micro_batches([3, 25, 4], max_rows=8, max_tokens=10) == [[0, 2], [1]]


def test_groups_stay_together_and_in_order():
    lengths = [4, 5, 9, 9, 1, 2, 6, 6]  # pairs (0,1) 9, (2,3) 18, (4,5) 3, (6,7) 12
    plan = plan_micro_batches(lengths, max_rows=4, max_tokens=20, group=2)
    assert plan == [[0, 1, 4, 5], [2, 3], [6, 7]]
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        plan_micro_batches([1, 2, 3], max_rows=4, group=2)
    assert plan_micro_batches([1] * 6, max_rows=3, group=2) == [[0, 1], [2, 3], [4, 5]]  # whole pairs only


@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_within_both_caps(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
    rows, budget = rng.randint(1, 9), rng.randint(30, 120)
    plan = plan_micro_batches(lengths, rows, budget)
    assert sorted(r for mb in plan for r in mb) == list(range(len(lengths)))
    for mb in plan:
        assert mb == sorted(mb) and len(mb) <= rows
        assert sum(lengths[r] for r in mb) <= budget or len(mb) == 1
    assert [mb[0] for mb in plan] == sorted(mb[0] for mb in plan)


def test_outputs_go_back_in_row_order():
    parts = [(torch.tensor([0, 3]), torch.tensor([[1.0], [4.0]])), (torch.tensor([1, 2]), torch.tensor([[2.0], [3.0]]))]
    assert in_row_order(parts, 4)[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    sliced = [(slice(0, 2), torch.tensor([1.0, 2.0])), (slice(2, 3), torch.tensor([3.0]))]
    assert in_row_order(sliced, 3).tolist() == [1.0, 2.0, 3.0]
