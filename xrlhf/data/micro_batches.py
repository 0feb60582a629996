"""Which rows go into which micro-batch: a row cap, and optionally a token budget.

Why a module: a micro-batch of ``micro_batch_size`` rows costs what its *tokens* cost, and RL
batches mix short and long sequences, so a fixed row count either wastes the device on short
rows or runs out of memory on long ones. Filling micro-batches to a token budget (verl's
``use_dynamic_bsz``, OpenRLHF's ``use_dynamic_batch``) keeps each forward near the same size.
The plan is a pure function of the rows' lengths, so every engine (and a test) gets the same
split; the train and infer templates of ``xrlhf.engines.base`` call it.

The loss contract does not care how rows are grouped: each micro-batch's loss is a sum over
its units divided by the global unit count (``engines.base.LossFn``), so any partition of the
rows gives the same update up to float summation order.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def plan_micro_batches(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None,
                       group: int = 1) -> list[list[int]]:
    """Split rows into micro-batches, each a sorted list of row indices.

    Args:
        lengths: ``B`` token counts, one per row (the attended tokens: what a packed forward
            computes).
        max_rows: the most rows in one micro-batch (``micro_batch_size``).
        max_tokens: the most tokens in one micro-batch; ``None``: no budget, and the result is
            ``Batch.chunks(max_rows)``'s consecutive split.
        group: rows that must stay together and in order (``group`` consecutive rows: DPO and
            reward-model pairs are interleaved ``[chosen_0, rejected_0, ...]``); ``B`` must
            divide by it.

    Returns:
        Micro-batches ordered by their first row, every row in exactly one. With a budget, a
        group longer than ``max_tokens`` gets a micro-batch of its own (never truncated); the
        others start in ``K = max(ceil(tokens / max_tokens), ceil(rows / max_rows))``
        micro-batches and are placed longest first into the one with the fewest tokens that
        still has room for them (rows and tokens), a new one opened when none has: the
        micro-batches come out balanced, as verl's ``rearrange_micro_batches``, and within
        both caps.

    Raises:
        ValueError: ``B`` does not divide by ``group``, or a cap below 1.
    """
    n = len(lengths)
    if max_rows < 1 or (max_tokens is not None and max_tokens < 1) or group < 1:
        raise ValueError(f"plan_micro_batches: max_rows {max_rows}, max_tokens {max_tokens} and group {group} "
                         f"must be >= 1")
    if n % group:
        raise ValueError(f"plan_micro_batches: {n} rows do not split into groups of {group}")
    cap = max(group, max_rows - max_rows % group)  # whole groups only
    if max_tokens is None:
        return [list(range(s, min(s + cap, n))) for s in range(0, n, cap)]
    sizes = [sum(lengths[g:g + group]) for g in range(0, n, group)]
    alone = [[g] for g in range(len(sizes)) if sizes[g] > max_tokens]  # longer than the budget: own micro-batch
    rest = [g for g in range(len(sizes)) if sizes[g] <= max_tokens]
    k = max(math.ceil(sum(sizes[g] for g in rest) / max_tokens), math.ceil(len(rest) * group / cap))
    bins: list[list[int]] = [[] for _ in range(k)]
    tokens = [0] * k
    for g in sorted(rest, key=lambda i: (-sizes[i], i)):
        fits = [b for b in range(len(bins)) if (len(bins[b]) + 1) * group <= cap and tokens[b] + sizes[g] <= max_tokens]
        if not fits:
            bins.append([])
            tokens.append(0)
            fits = [len(bins) - 1]
        b = min(fits, key=lambda j: (tokens[j], j))
        bins[b].append(g)
        tokens[b] += sizes[g]
    bins += alone
    out = [sorted(r for g in b for r in range(g * group, g * group + group)) for b in bins if b]
    return sorted(out, key=lambda rows: rows[0])


def in_row_order(parts: Sequence[tuple[torch.Tensor | slice, torch.Tensor]], n: int) -> torch.Tensor:
    """Micro-batch outputs back in row order: ``(rows, [b_k, ...])`` pairs, ``rows`` a slice or an
    index tensor of the ``n`` rows, -> one ``[n, ...]`` fp32 CPU tensor (consecutive slices are
    concatenated as they are)."""
    if all(isinstance(rows, slice) for rows, _ in parts):
        return torch.cat([x for _, x in parts]).float().cpu()
    out = torch.zeros((n, *parts[0][1].shape[1:]), dtype=torch.float32)
    for rows, x in parts:
        out[rows] = x.float().cpu()
    return out
