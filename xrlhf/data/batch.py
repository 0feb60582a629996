"""``Batch``: a dict of tensors that share their first dimension, split and gathered by rank.

The layout of one RL sample, used by every engine and algorithm::

    input_ids      [B, P + R]  prompt left-padded to width P, response right-padded to R
    attention_mask [B, P + R]  1 on real tokens
    response_mask  [B, R]      1 on generated tokens (the stop token included)

Per-token quantities of the response (logprobs, values, advantages, ...) are ``[B, R]`` and
line up with ``input_ids[:, P:]``. Non-tensor values travel in ``meta`` (shared by all rows).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch


@dataclass
class Batch:
    """Tensors with a common batch dimension, plus shared non-tensor ``meta``."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch tensors disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self.tensors and value.shape[0] != len(self):
            raise ValueError(f"{key}: batch size {value.shape[0]} != {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self):
        return self.tensors.keys()

    def select(self, *keys: str) -> "Batch":
        return Batch({k: self.tensors[k] for k in keys}, dict(self.meta))

    def index(self, idx: torch.Tensor | slice) -> "Batch":
        return Batch({k: v[idx] for k, v in self.tensors.items()}, dict(self.meta))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The tensors on ``device``. ``non_blocking``: host-to-device copies do not wait for the
        device (safe from ordinary host memory: the copy is staged before the call returns)."""
        return Batch({k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}, dict(self.meta))

    def chunks(self, size: int) -> Iterator["Batch"]:
        """Consecutive pieces of at most ``size`` rows."""
        for start in range(0, len(self), size):
            yield self.index(slice(start, start + size))

    def split(self, n: int) -> list["Batch"]:
        """``n`` consecutive, equal pieces; the batch size must divide by ``n``."""
        if len(self) % n:
            raise ValueError(f"batch of {len(self)} rows does not split into {n} equal parts")
        return list(self.chunks(len(self) // n))

    @staticmethod
    def cat(parts: Sequence["Batch"]) -> "Batch":
        """Concatenate along the batch dimension (pads the last dim of 2-D tensors if widths differ)."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return Batch()
        keys = parts[0].tensors.keys()
        out = {}
        for k in keys:
            ts = [p.tensors[k] for p in parts]
            out[k] = torch.cat(ts) if len({t.shape[1:] for t in ts}) == 1 else _cat_padded(k, ts)
        return Batch(out, dict(parts[0].meta))


def _cat_padded(key: str, ts: list[torch.Tensor]) -> torch.Tensor:
    if any(t.dim() != 2 for t in ts):
        raise ValueError(f"cannot concatenate {key!r} of shapes {[tuple(t.shape) for t in ts]}")
    width = max(t.shape[1] for t in ts)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in ts])


def build_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                    pad_id: int, response_logprobs: Sequence[Sequence[float]] | None = None,
                    response_masks: Sequence[Sequence[float]] | None = None) -> Batch:
    """Lay out prompts (left-padded) and responses (right-padded) as one ``Batch``.

    Args:
        prompts: ``B`` lists of prompt token ids.
        responses: ``B`` lists of response token ids (may be empty).
        pad_id: the padding token id.
        response_logprobs: optional ``B`` lists of the sampler's logprob per response token.
        response_masks: optional ``B`` lists of the loss mask of each response token (a
            multi-turn episode: 0 on the env's observation tokens, which are attended to but not
            trained); default 1 on every response token.

    Returns:
        ``input_ids``/``attention_mask`` ``[B, P+R]``, ``response_mask`` ``[B, R]`` and, when
        given, ``rollout_logprobs`` ``[B, R]`` (0 on padding). ``R`` is at least 1.
    """
    # In numpy, one conversion per field and masked writes instead of a tensor per row: a rollout of
    # 256 x 480 tokens is laid out on the driver between generation and the next forward.
    plen = np.fromiter(map(len, prompts), np.int64, len(prompts))
    rlen = np.fromiter(map(len, responses), np.int64, len(responses))
    p, r = int(plen.max()), max(1, int(rlen.max()))
    left = np.arange(p) >= (p - plen)[:, None]  # [B, P]: where each prompt sits
    right = np.arange(r) < rlen[:, None]  # [B, R]: where each response sits
    ids = np.full((len(prompts), p + r), pad_id, dtype=np.int64)
    ids[:, :p][left] = _flat(prompts, np.int64)
    ids[:, p:][right] = _flat(responses, np.int64)
    rmask = right.astype(np.float32)
    if response_masks is not None:
        rmask[right] = _per_token(response_masks, responses, "mask values")
    lps = np.zeros((len(prompts), r), dtype=np.float32)
    if response_logprobs is not None:
        lps[right] = _per_token(response_logprobs, responses, "logprobs")
    ids, attn = torch.from_numpy(ids), torch.from_numpy(np.concatenate([left, right], axis=1).astype(np.int64))
    rmask, lps = torch.from_numpy(rmask), torch.from_numpy(lps)
    out = {"input_ids": ids, "attention_mask": attn, "response_mask": rmask}
    if response_logprobs is not None:
        out["rollout_logprobs"] = lps
    return Batch(out)


def right_padded(rows: Sequence[Sequence[Any]], width: int, dtype: type = np.int64) -> torch.Tensor:
    """``[B, width]``: row ``i`` holds ``rows[i]`` from column 0 (at most ``width`` values), zeros after it."""
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    out = np.zeros((len(rows), width), dtype=dtype)
    out[np.arange(width) < lengths[:, None]] = _flat(rows, dtype)
    return torch.from_numpy(out)


def _per_token(values: Sequence[Sequence[float]], responses: Sequence[Sequence[int]], what: str) -> np.ndarray:
    """Each row's first ``len(response)`` values, end to end (float32)."""
    rows = [v[:len(rs)] for v, rs in zip(values, responses)]
    for i, (v, rs) in enumerate(zip(rows, responses)):
        if len(v) < len(rs):
            raise ValueError(f"build_sequences: row {i} has {len(v)} {what} for {len(rs)} response tokens")
    return _flat(rows, np.float32)


def _flat(rows: Sequence[Sequence[Any]], dtype: type) -> np.ndarray:
    """The rows' values end to end, ``[sum of lengths]``."""
    return np.fromiter(itertools.chain.from_iterable(rows), dtype, sum(map(len, rows)))


def unpack_sequences(batch: Batch) -> tuple[list[list[int]], list[list[int]]]:
    """Inverse of ``build_sequences``: the prompt and response token ids of every row (the
    response's every attended token: a multi-turn episode's observations included)."""
    ids, attn = batch["input_ids"], batch["attention_mask"].bool()
    p = ids.shape[1] - response_width(batch)
    prompts = [ids[i, :p][attn[i, :p]].tolist() for i in range(len(batch))]
    responses = [ids[i, p:][attn[i, p:]].tolist() for i in range(len(batch))]
    return prompts, responses


def response_loss_masks(batch: Batch) -> list[list[float]]:
    """Per row, the ``response_mask`` value of each response token ``unpack_sequences`` returns
    (0 on a multi-turn episode's observations), for ``build_sequences(..., response_masks=)``."""
    attn = batch["attention_mask"].bool()
    p = attn.shape[1] - response_width(batch)
    return [batch["response_mask"][i][attn[i, p:]].tolist() for i in range(len(batch))]


def response_width(batch: Batch) -> int:
    """``R``: the number of response columns of a batch in the layout above."""
    return batch["response_mask"].shape[1]
