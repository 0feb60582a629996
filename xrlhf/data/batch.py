"""``Batch``: a dict of tensors that share their first dimension, split and gathered by rank.

The layout of one RL sample, used by every engine and algorithm::

    input_ids      [B, P + R]  prompt left-padded to width P, response right-padded to R
    attention_mask [B, P + R]  1 on real tokens
    response_mask  [B, R]      1 on generated tokens (the stop token included)

Per-token quantities of the response (logprobs, values, advantages, ...) are ``[B, R]`` and
line up with ``input_ids[:, P:]``. Non-tensor values travel in ``meta`` (shared by all rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

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
    b = len(prompts)
    p = max(len(x) for x in prompts)
    r = max(1, max(len(x) for x in responses))
    ids = torch.full((b, p + r), pad_id, dtype=torch.long)
    attn = torch.zeros((b, p + r), dtype=torch.long)
    rmask = torch.zeros((b, r), dtype=torch.float32)
    lps = torch.zeros((b, r), dtype=torch.float32)
    for i, (pr, rs) in enumerate(zip(prompts, responses)):
        ids[i, p - len(pr):p] = torch.tensor(pr, dtype=torch.long)
        attn[i, p - len(pr):p] = 1
        if rs:
            ids[i, p:p + len(rs)] = torch.tensor(rs, dtype=torch.long)
            attn[i, p:p + len(rs)] = 1
            rmask[i, :len(rs)] = 1.0 if response_masks is None else torch.tensor(
                response_masks[i][:len(rs)], dtype=torch.float32)
            if response_logprobs is not None:
                lps[i, :len(rs)] = torch.tensor(response_logprobs[i][:len(rs)], dtype=torch.float32)
    out = {"input_ids": ids, "attention_mask": attn, "response_mask": rmask}
    if response_logprobs is not None:
        out["rollout_logprobs"] = lps
    return Batch(out)


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
