"""Data-parallel dispatch: split any batch over ranks, gather the results, weight the metrics.

Why: a handle must accept a batch of any size, yet every rank must get the same number of rows
(ZeRO-3 runs collectives per micro-batch: a rank with one fewer hangs its peers). So short parts
are padded with copies of real rows (``split``) and the copies dropped on the way back
(``gather``); in a train step (``split_train``) the copies get a zero ``response_mask`` (token
losses) or a zero ``row_weight`` (row-weighted losses), so they add nothing to the loss or the
gradient, and an uneven split is refused for pairwise losses (DPO, the reward model).
``gather_metrics`` weights each rank's means by its real units. Ray-free: the Ray handle and the
in-process handle both dispatch through ``plan``. The rules in full: docs/architecture.md
("Padding belongs to dispatch").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from xrlhf.data.batch import Batch

DP, DP_TRAIN, ALL, RANK0, ONE, EACH = "dp", "dp_train", "all", "rank0", "one", "each"
"""Dispatch modes: split the first argument over the ranks (``DP``), the same for a train step
(``DP_TRAIN``: padding rows weigh nothing, metrics weighted by units), the same call on every
rank (``ALL``, a list of per-rank results back), rank 0 only (``RANK0``), the rank given as the
first argument only, with the other arguments (``ONE``: an episode's turns stay on one
generator, no padding copies), rank ``r`` with item ``r`` of the first argument (``EACH``: one
weight-sync message per rank)."""


@dataclass(frozen=True)
class Split:
    """A batch cut into one equal-sized part per rank.

    Attributes:
        parts: ``R`` parts (``Batch`` or list), each of ``ceil(N / R)`` rows.
        real: ``R`` counts of real rows; part ``r``'s rows ``real[r]:`` are padding copies.
    """

    parts: list[Any]
    real: list[int]

    @property
    def padded(self) -> bool:
        """Whether some part holds padding copies (``R`` does not divide ``N``)."""
        return any(len(p) != k for p, k in zip(self.parts, self.real))


def part_sizes(n: int, ranks: int) -> list[int]:
    """Real rows per rank: ``n`` over ``ranks`` as evenly as possible, larger parts first."""
    if ranks < 1:
        raise ValueError(f"cannot split over {ranks} ranks")
    k, extra = divmod(n, ranks)
    return [k + (r < extra) for r in range(ranks)]


def split(x: Batch | Sequence[Any], ranks: int) -> Split:
    """Cut ``x`` (a ``Batch`` or a list of per-row items, e.g. prompts) into ``ranks`` parts of
    equal length, padding short parts with copies of real rows (see the module docstring)."""
    if not isinstance(x, (Batch, list, tuple)):
        raise TypeError(f"cannot split a {type(x).__name__} across ranks")
    n = len(x)
    if n == 0:
        raise ValueError("cannot split an empty batch across ranks")
    sizes = part_sizes(n, ranks)
    width = sizes[0]
    parts, start = [], 0
    for size in sizes:
        rows = list(range(start, start + size))
        pad = [rows[i % size] if size else 0 for i in range(width - size)]
        parts.append(_take(x, rows + pad, contiguous=not pad, start=start, size=size))
        start += size
    return Split(parts, sizes)


def _take(x: Batch | Sequence[Any], rows: list[int], contiguous: bool, start: int, size: int) -> Any:
    if isinstance(x, Batch):
        # a slice when nothing is padded: the very tensors (views) of the old equal split
        return x.index(slice(start, start + size)) if contiguous else x.index(torch.tensor(rows, dtype=torch.long))
    return [x[i] for i in rows]


def split_train(batch: Batch, ranks: int, unit: str, row_weighted: bool = False) -> Split:
    """``split`` for a train step: padding rows get an all-zero ``response_mask`` so they add
    nothing to a token-unit loss. A sequence-unit loss counts rows: where ``ranks`` does not
    divide them, every part gets ``row_weight`` ``[rows]`` (1 real, 0 copy), which the engines
    count as the rows and a ``row_weighted`` loss honours (KTO); any other sequence-unit loss
    raises ``ValueError`` (a copy would count in its mean over rows)."""
    if not isinstance(batch, Batch):
        raise TypeError(f"train_step takes a Batch, got {type(batch).__name__}")
    uneven = len(batch) % ranks != 0
    if unit != "token" and uneven and not row_weighted:
        raise ValueError(f"train_step: a {unit}-unit loss needs a batch whose rows divide by the handle's "
                         f"ranks, got {len(batch)} rows for {ranks} ranks (a padding copy would count in the "
                         f"mean over rows); make the batch size a multiple of the ranks")
    out = split(batch, ranks)
    for part, real in zip(out.parts, out.real):
        if len(part) > real:
            mask = part["response_mask"].clone()
            mask[real:] = 0
            part["response_mask"] = mask
        if unit != "token" and uneven:
            weight = torch.ones(len(part))
            weight[real:] = 0.0
            part["row_weight"] = weight
    return out


def units(part: Batch, real: int, unit: str) -> float:
    """A part's real loss units: response tokens of its first ``real`` rows, or ``real``."""
    if unit == "token":
        return float(part["response_mask"][:real].sum())
    return float(real)


def gather(results: list[Any], real: Sequence[int]) -> Any:
    """Concatenate the ranks' per-row results in rank order, dropping each part's padding.

    ``Batch``, lists and dataclasses whose fields are all per-row lists (``GenerationOutput``)
    are concatenated; anything else comes back as the list of per-rank results.
    """
    first = results[0]
    if isinstance(first, Batch):
        return Batch.cat([r.index(slice(0, k)) if len(r) != k else r for r, k in zip(results, real)])
    if isinstance(first, list):
        return [x for r, k in zip(results, real) for x in r[:k]]
    if dataclasses.is_dataclass(first) and all(isinstance(getattr(first, f.name), list)
                                               for f in dataclasses.fields(first)):
        return type(first)(**{f.name: [x for r, k in zip(results, real) for x in getattr(r, f.name)[:k]]
                              for f in dataclasses.fields(first)})
    return results


def gather_metrics(metrics: list[dict[str, float]], weights: Sequence[float]) -> dict[str, float]:
    """Per-rank metric means -> their mean weighted by each rank's units (``sum w m / sum w``).

    Ranks with no units (all padding) are left out; with no units anywhere, a plain mean. A key
    missing on some rank is averaged over the ranks that have it.
    """
    keep = [(m, float(w)) for m, w in zip(metrics, weights) if w > 0] or [(m, 1.0) for m in metrics]
    out: dict[str, float] = {}
    for k in metrics[0]:
        pairs = [(float(m[k]), w) for m, w in keep if k in m] or [(float(metrics[0][k]), 1.0)]
        if all(v == pairs[0][0] for v, _ in pairs):  # the same on every rank (lr, grad_norm): exactly it
            out[k] = pairs[0][0]
        elif k.endswith("_max"):  # a maximum over the mini-batch: the largest rank's
            out[k] = max(v for v, _ in pairs)
        else:
            out[k] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    return out


Call = tuple[tuple[Any, ...], dict[str, Any]]


def plan(mode: str, ranks: int, args: tuple[Any, ...], kwargs: dict[str, Any], split_kwargs: tuple[str, ...] = ()
         ) -> tuple[list[int], list[Call], Callable[[list[Any]], Any]]:
    """How a handle method's call is spread: the ranks to call, each one's ``(args, kwargs)``
    and the function that combines their results (in the order of those ranks).

    ``DP`` / ``DP_TRAIN`` split ``args[0]`` (``DP_TRAIN`` reads the loss unit from ``args[1]``);
    ``DP`` also splits the keyword arguments named in ``split_kwargs`` that are not ``None``
    (per-row lists such as ``generate``'s ``seeds``) alike, padding included.
    """
    if mode == DP and any(kwargs.get(k) is not None for k in split_kwargs):
        ranks_, calls, combine = plan(mode, ranks, args, {k: v for k, v in kwargs.items() if k not in split_kwargs})
        for key in split_kwargs:
            value = kwargs.get(key)
            if value is None:
                continue
            if len(value) != len(args[0]):
                raise ValueError(f"{key}: {len(value)} values for {len(args[0])} rows")
            for (_, kw), part in zip(calls, split(list(value), ranks).parts):
                kw[key] = part
        return ranks_, calls, combine
    if mode in (DP, DP_TRAIN):
        if mode == DP_TRAIN:
            unit = args[1].unit
            s = split_train(args[0], ranks, unit, args[1].row_weighted)
            weights = [units(p, k, unit) for p, k in zip(s.parts, s.real)]
            combine = lambda results: gather_metrics(results, weights)  # noqa: E731
        else:
            s = split(args[0], ranks)
            combine = lambda results: gather(results, s.real)  # noqa: E731
        return list(range(ranks)), [((p, *args[1:]), dict(kwargs)) for p in s.parts], combine
    if mode == ALL:
        return list(range(ranks)), [(args, kwargs)] * ranks, list
    if mode == RANK0:
        return [0], [(args, kwargs)], lambda results: results[0]
    if mode == ONE:
        rank = args[0]
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} of a handle with {ranks} ranks")
        return [rank], [(args[1:], kwargs)], lambda results: results[0]
    if mode == EACH:
        if len(args[0]) != ranks:
            raise ValueError(f"{len(args[0])} per-rank arguments for a handle with {ranks} ranks")
        return list(range(ranks)), [((a, *args[1:]), kwargs) for a in args[0]], list
    raise ValueError(f"unknown dispatch mode {mode!r}; valid: {DP}, {DP_TRAIN}, {ALL}, {RANK0}, {ONE}, {EACH}")
