"""How a micro-batch is laid out for the model: packed into one row, or padded (and trimmed).

Why a module: a micro-batch in the ``Batch`` layout (``xrlhf.data.batch``: prompts
left-padded to ``P``, responses right-padded to ``R``) spends compute on every padding
column. Packing puts the attended tokens of every row one after the other in a single row
``[1, T]`` (``T`` = the real tokens only) with position ids that restart at 0 for each
sequence, the layout verl (``use_remove_padding``) and OpenRLHF (``packing_samples``) give
the model; a variable-length attention (``engines.hf.attention``) keeps the sequences apart.
Where that is not possible the padded layout is the fallback: the same rows, trimmed of the
columns that are padding in every row.

Both layouts tell the forward the same three things, so the rest of the forward does not
care which one it got:

* ``inputs``: the model's keyword arguments;
* ``keep`` ``[n]``: the positions (dimension 1 of the model's input) whose hidden state
  predicts a response token (the token before it), ``targets`` ``[b', n]`` those tokens;
* ``to_rows(x)``: ``[b', n]`` values at those positions back to the batch's ``[B, R]``,
  zero where no response token is.

The response token at column ``P + j`` of row ``i`` is predicted by the previous attended
token of the row, which is what the padded forward has always read (``logits[:, P + j - 1]``).
A response token with no attended token before it in its row gets 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


@dataclass
class Packed:
    """A micro-batch packed into one row (see the module docstring).

    Attributes:
        input_ids, position_ids: ``[1, T]``, position ids restarting at 0 per sequence.
        cu_seqlens: ``[S + 1]`` int32 offsets of the ``S`` non-empty sequences in the row.
        max_len: the longest sequence (a Python int: flash kernels take it on the host).
        keep: ``[N]`` packed index of the token before each predicted response token.
        targets: ``[1, N]`` the predicted response tokens.
        rows, cols: ``[N]`` where each predicted token sits in ``[B, R]``.
        last: ``[B]`` packed index of each row's last token (-1 for an empty row).
        shape: ``(B, R)``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    keep: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    last: torch.Tensor
    shape: tuple[int, int]
    packed: bool = field(default=True, init=False)

    def to(self, device: torch.device) -> "Packed":
        return _to(self, device)

    @property
    def inputs(self) -> dict[str, Any]:
        """Keyword arguments of the model call: no attention mask (transformers' packed-sequence
        path), and the sequence offsets every varlen attention takes (``cu_seq_lens_*``)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len}

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, N, ...]`` values at ``keep`` -> ``[B, R, ...]`` (zeros elsewhere; differentiable)."""
        out = values.new_zeros((*self.shape, *values.shape[2:]))
        return out.index_put((self.rows, self.cols), values.reshape(-1, *values.shape[2:]))

    def from_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, R, ...]`` per response position -> ``[1, N, ...]`` at the predicted positions."""
        return values[self.rows, self.cols].unsqueeze(0)

    def last_token(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[1, T]`` per-token values -> ``[B]``: each row's value at its last token (0 if empty)."""
        flat = per_token.reshape(-1)
        return torch.where(self.last >= 0, flat[self.last.clamp(min=0)], flat.new_zeros(()))


@dataclass
class Padded:
    """A micro-batch in the padded layout, trimmed of all-padding columns.

    Attributes:
        input_ids, attention_mask, position_ids: ``[B, L']`` (``L' <= L``).
        keep: ``[R']`` the columns whose hidden state predicts response columns ``0..R'-1``.
        targets: ``[B, R']``.
        shape: ``(B, R)``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    targets: torch.Tensor
    shape: tuple[int, int]
    packed: bool = field(default=False, init=False)

    def to(self, device: torch.device) -> "Padded":
        return _to(self, device)

    @property
    def inputs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "position_ids": self.position_ids}

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, R', ...]`` -> ``[B, R, ...]``, zeros on the trimmed columns (differentiable)."""
        return torch.nn.functional.pad(values, (0, 0) * (values.dim() - 2) + (0, self.shape[1] - values.shape[1]))

    def from_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, R, ...]`` per response position -> ``[B, R', ...]``, the kept columns."""
        return values[:, :self.targets.shape[1]]


def _to(layout: Any, device: torch.device) -> Any:
    """``layout`` with its tensors on ``device``, copied without waiting for the device. A layout
    is built where the batch's mask lives (the host, for a micro-batch of a train or infer call),
    so its data-dependent sizes (``max_len``, the trimmed width) are read there and the device's
    queue never drains between two micro-batches."""
    moved = {f.name: getattr(layout, f.name).to(device, non_blocking=True) for f in fields(layout)
             if f.init and isinstance(getattr(layout, f.name), torch.Tensor)}
    return replace(layout, **moved)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> Packed:
    """The attended tokens of every row, one row after the other.

    Args:
        input_ids, attention_mask: ``[B, L]`` in the ``Batch`` layout.
        response_width: ``R``, the last ``R`` columns are the response.

    Returns:
        ``Packed`` on the inputs' device; see the class for the shapes.
    """
    b, width = input_ids.shape
    r = response_width
    real = attention_mask.bool()
    lengths = real.sum(-1)
    pos_in_row = real.long().cumsum(-1) - 1  # [B, L] position of each attended token in its row
    index = (real.reshape(-1).long().cumsum(0) - 1).view(b, width)  # [B, L] packed index of attended tokens
    predicted = real[:, width - r:] & (pos_in_row[:, width - r:] > 0)  # [B, R]: has a token before it
    rows, cols = predicted.nonzero(as_tuple=True)
    keep = index[:, width - r:][rows, cols] - 1
    targets = input_ids[:, width - r:][rows, cols]
    host_lengths = lengths.tolist()
    seq = torch.tensor([0] + [n for n in host_lengths if n], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ends = lengths.cumsum(0) - 1
    return Packed(input_ids=input_ids[real].unsqueeze(0), position_ids=pos_in_row[real].unsqueeze(0),
                  cu_seqlens=seq.to(input_ids.device), max_len=max(host_lengths, default=0), keep=keep,
                  targets=targets.unsqueeze(0), rows=rows, cols=cols,
                  last=torch.where(lengths > 0, ends, torch.full_like(ends, -1)), shape=(b, r))


def pad_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> Padded:
    """The rows as they are, minus the columns that are padding in every row.

    Position ids count the attended tokens of each row (``cumsum(mask) - 1``), as the padded
    forward always has. The prompt part keeps at least one column (the token before the first
    response token).

    Args:
        input_ids, attention_mask: ``[B, L]`` in the ``Batch`` layout.
        response_width: ``R``.
    """
    b, width = input_ids.shape
    p = width - response_width
    used = attention_mask.bool().any(0)
    first = int(used[:p].nonzero()[0]) if bool(used[:p].any()) else p - 1
    first = max(0, min(first, p - 1))
    r_used = int(used[p:].nonzero()[-1]) + 1 if bool(used[p:].any()) else 1
    ids = input_ids[:, first:p + r_used]
    attn = attention_mask[:, first:p + r_used]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    p_kept = p - first
    keep = torch.arange(p_kept - 1, p_kept - 1 + r_used, device=input_ids.device)
    return Padded(input_ids=ids, attention_mask=attn, position_ids=pos, keep=keep,
                  targets=ids[:, p_kept:], shape=(b, response_width))
