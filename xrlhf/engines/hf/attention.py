"""Attention over packed sequences: the varlen attention function ``HFModel`` registers.

Why a module: a packed row (``engines.hf.packing``) holds several sequences; attention must not
cross from one to the next. Transformers 5.x offers two ways, and xrlhf adds a third:

* ``flash_attention_2/3``: with ``cu_seq_lens_q/k`` and ``max_length_q/k`` in the model's
  kwargs, transformers runs the flash varlen kernel (modeling_flash_attention_utils.py). Not
  installed on our GPU image (flash-attn has no wheel for its torch).
* ``masked``: with ``attention_mask=None`` and no cache, ``masking_utils`` finds the sequence
  boundaries in ``position_ids`` (``find_packed_sequence_indices``) and builds a block-diagonal
  causal mask for ``sdpa``, ``eager`` and ``flex_attention``. Exact, but dense: ``T**2`` for
  a packed row of ``T`` tokens, where the sequences need only the sum of their squares.
* ``varlen`` (ours): the attention function ``xrlhf_varlen`` registered with transformers'
  ``AttentionInterface``; the model's ``_attn_implementation`` names it, and each layer calls
  it with the ``cu_seq_lens_*`` kwargs. On CUDA with bf16/fp16 it calls torch's
  FlashAttention varlen kernel (``torch.nn.attention.varlen``, torch >= 2.10, with a
  backward); elsewhere (CPU, fp32, attention dropout) one SDPA call over the sequences laid
  out side by side, each padded to the longest and masked: padding inside the attention only,
  none in the linear layers. Its mask function builds no mask for a packed
  row and sdpa's mask for a padded batch, which the function then hands to transformers'
  sdpa: the same model runs both layouts (the probe compares them).

Which of them a model takes is decided when its engine is built (``engines.hf.probe``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

NAME = "xrlhf_varlen"
"""The name ``xrlhf_varlen`` is registered under in transformers' ``AttentionInterface``."""

MARK = "xrlhf_attention"
"""The attribute ``set_attention`` leaves on a model (a plain attribute: no weight, not saved)."""

DEFAULT = "sdpa"
"""The implementation transformers gives a model loaded without ``attn_implementation`` (xrlhf
asks for none)."""


def set_attention(module, name: str) -> None:
    """``module.set_attn_implementation(name)`` (public), remembered for ``attention_of``."""
    module.set_attn_implementation(name)
    setattr(module, MARK, name)


def attention_of(module) -> str:
    """The attention implementation a transformers model runs: what ``set_attention`` set last,
    else transformers' default. Transformers has no public getter (``config._attn_implementation``
    is private); a hook that read it bought nothing measurable (docs/internals.md)."""
    return getattr(module, MARK, DEFAULT)

_FLASH_FAILED: list[str] = []
"""Why torch's varlen kernel failed in this process, if it did; then every call takes the SDPA path."""


TAKEN: dict[str, str] = {}
"""What the attention calls of this process ran, as ``"<kernel> (<dtype> on <device>[: why])"``
(to the kernel): decided by ``varlen_attention`` from the tensors it is given, so it tells what
actually ran (a fp32 ``q`` under autocast took the SDPA path while the config promised flash
attention). ``HFModel`` collects it after each forward and logs each new entry once
(``unreported``)."""
_LAST: list[str | None] = [None]
"""What the last attention call ran: a one-slot list, which a compiled layer writes on every call
without a graph break or a guard on its contents (a dict write recompiles once it is no longer
empty)."""
_REPORTED: set[str] = set()
_PROBING: list[bool] = []

_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
FLASH = "torch varlen flash attention"
SIDE_BY_SIDE = "SDPA over the sequences side by side"


def _ran(kernel: str, query: torch.Tensor, why: str = "") -> None:
    _LAST[0] = f"{kernel} ({_DTYPE.get(query.dtype, 'other dtype')} on {query.device.type}{why})"


@contextmanager
def unrecorded() -> Iterator[None]:
    """Calls within the block leave ``TAKEN`` as it was (the probe's forwards: ``TAKEN`` tells
    what the engine's own forwards ran)."""
    before = dict(TAKEN)
    _PROBING.append(True)
    try:
        yield
    finally:
        _PROBING.pop()
        _LAST[0] = None
        TAKEN.clear()
        TAKEN.update(before)


def unreported() -> list[str]:
    """Record what the last forward ran in ``TAKEN``; the entries not returned before (each is
    returned once per process)."""
    if _LAST[0] is not None:
        TAKEN.setdefault(_LAST[0], _LAST[0].split(" (")[0])
        _LAST[0] = None
    if len(_REPORTED) == len(TAKEN) or _PROBING:
        return []
    new = [k for k in TAKEN if k not in _REPORTED]
    _REPORTED.update(new)
    return new


def _flash_failed(error: Exception) -> None:
    from loguru import logger

    if not _FLASH_FAILED:
        _FLASH_FAILED.append(f"{type(error).__name__}: {str(error)[:200]}")
        logger.warning(f"{NAME}: torch's varlen flash attention failed ({_FLASH_FAILED[0]}); packed micro-batches "
                       f"use one masked SDPA over the sequences instead")


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, softcap: float | None = None, **kwargs: Any
                     ) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence (transformers' attention-function interface).

    Args:
        query: ``[1, Hq, T, D]``; key, value: ``[1, Hkv, T, D]`` (``Hq`` a multiple of ``Hkv``).
        kwargs: ``cu_seq_lens_q`` ``[S + 1]`` (int32 offsets of the sequences) and
            ``max_length_q`` (int), as ``engines.hf.packing.Packed.inputs`` passes them.

    Returns:
        ``([1, T, Hq, D], None)``.

    A call without ``cu_seq_lens_q`` (a padded batch) is transformers' sdpa attention with the
    mask ``varlen_mask`` made.

    Raises:
        ValueError: ``cu_seq_lens_q`` with more than one row.
        NotImplementedError: a sliding window, a soft cap or attention sinks (the probe then
            falls back to another path).
    """
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _ran("transformers sdpa on padded rows", query)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    if max_len is None or query.shape[0] != 1:
        raise ValueError(f"{NAME}: a packed forward passes cu_seq_lens_q and max_length_q with one row")
    if sliding_window or softcap or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{NAME}: sliding windows, soft caps and sinks are not supported")
    groups = query.shape[1] // key.shape[1]
    why = _no_flash(query, dropout)
    if not why:
        flash = _torch_varlen(query.shape[-1], scaling)
        why = "" if flash is not None else ": this torch has no varlen flash kernel for the scale"
        if flash is not None:
            try:
                q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D]
                out = flash(q, k, v, cu, max_len, scaling, groups).unsqueeze(0)
                _ran(FLASH, query)
                return out, None
            except RuntimeError as e:  # an architecture or build the kernel does not support: say so once
                _flash_failed(e)
                why = ": the flash kernel failed"
    _ran(SIDE_BY_SIDE, query, why)
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return _padded_sdpa(query, key, value, cu, int(max_len), dropout, scaling), None


def _no_flash(query: torch.Tensor, dropout: float) -> str:
    """Why the flash kernel cannot take ``query`` (``""``: it can)."""
    if not query.is_cuda:
        return ": not a GPU"
    if query.dtype not in (torch.bfloat16, torch.float16):
        return ": flash takes bf16 or fp16 q/k/v"
    if dropout:
        return ": attention dropout"
    return ": the flash kernel failed before" if _FLASH_FAILED else ""


def _padded_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, max_len: int,
                 dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal attention within each sequence in one SDPA call: the ``S`` sequences of the packed
    ``[1, H, T, D]`` inputs laid out as ``[S, H, max_len, D]``, keys past a sequence's end masked,
    and the real positions gathered back to ``[1, T, H, D]``. Padding exists only inside this
    call (``S * max_len**2`` attention), not in the model's linear layers."""
    lengths = (cu[1:] - cu[:-1]).long()
    steps = torch.arange(max_len, device=query.device)
    real = steps < lengths[:, None]  # [S, max_len]
    index = (cu[:-1, None].long() + steps).clamp(max=query.shape[2] - 1)  # [S, max_len] into T
    q, k, v = (x[0][:, index].transpose(0, 1) for x in (query, key, value))  # [S, H, max_len, D]
    mask = torch.ones(max_len, max_len, dtype=torch.bool, device=query.device).tril() & real[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    t = query.shape[2]  # each packed token's place in [S * max_len], without a data-dependent shape (compile)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=query.device), lengths, output_size=t)
    flat = seq * max_len + torch.arange(t, device=query.device) - cu[:-1].long()[seq]
    return out.transpose(1, 2).flatten(0, 1)[flat].unsqueeze(0)  # [1, T, H, D], the packed order


def varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of ``xrlhf_varlen`` (transformers' mask interface): none for a packed
    row (``attention_mask`` is ``None``; the sequence offsets keep the sequences apart, and a
    ``[T, T]`` mask would cost what varlen saves), sdpa's for a padded batch."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


_NO_MASK: dict[torch.device, torch.Tensor] = {}


def no_mask(device: torch.device) -> torch.Tensor:
    """The attention mask a packed row's model call passes under ``xrlhf_varlen``: a 4-D
    placeholder (``[1, 1, 1, 1]``), which ``varlen_attention`` never reads (the sequence offsets
    keep the sequences apart).

    Why: with no mask, transformers looks for sequence boundaries in ``position_ids``
    (masking_utils ``find_packed_sequence_indices``, an ``.all()`` on the device: one sync per
    forward, so one per micro-batch), then asks ``varlen_mask``, which returns
    none anyway. A 4-D mask it takes as prepared and passes through untouched
    (``_preprocess_mask_arguments``)."""
    if device not in _NO_MASK:
        _NO_MASK[device] = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    return _NO_MASK[device]


_VARLEN: dict[tuple[int, float | None], Callable | None] = {}
"""``_torch_varlen``'s answers by ``(head_dim, scaling)``: a plain dict, which ``torch.compile``
reads as a constant (through an ``lru_cache`` it traces the wrapped function again, reading the
kernel's signature inside the graph, and warns of "potential silent incorrectness")."""


def _torch_varlen(head_dim: int, scaling: float | None) -> Callable | None:
    """torch's varlen flash attention as ``(q, k, v [T, H, D], cu, max_len, scale, groups) ->
    [T, Hq, D]``, or ``None`` where this torch lacks it or cannot take the scale. Its signature
    changed: torch 2.10 takes ``is_causal``; later ones ``window_size=(-1, 0)``, ``scale`` and
    ``enable_gqa``. Read once per key (``_VARLEN``); the function returned decides nothing at
    call time, so a compiled layer traces it whole."""
    key = (head_dim, scaling)
    if key not in _VARLEN:
        _VARLEN[key] = _build_varlen(head_dim, scaling)
    return _VARLEN[key]


@torch.compiler.disable
def _build_varlen(head_dim: int, scaling: float | None) -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params and "is_causal" not in params:
        return None
    if "scale" not in params and scaling is not None and abs(scaling - head_dim ** -0.5) > 1e-6 * scaling:
        return None
    fixed: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    takes_scale, takes_gqa = "scale" in params, "enable_gqa" in params

    def call(q, k, v, cu, max_len, scale, groups):
        kw = dict(fixed, scale=scale) if takes_scale else dict(fixed)
        if groups > 1 and takes_gqa:
            kw["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)

    return call


def install_varlen(module: torch.nn.Module, dtype: torch.dtype | None = None) -> Callable[[], None] | str:
    """Make ``module`` (a transformers model) attend by sequence in a packed row.

    A flash implementation needs nothing (transformers reads ``cu_seq_lens_*``); ``sdpa`` and
    ``eager`` are switched to ``xrlhf_varlen``. ``dtype``: the one attention computes in (default:
    the weights'). Returns the function that undoes it, or a reason why it cannot be done.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    current = attention_of(module)
    if current.startswith("flash_attention") or current == NAME:
        return lambda: None
    if current not in ("sdpa", "eager"):
        return f"attention implementation {current!r} has no varlen path here (packing: masked may serve)"
    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, varlen_mask)
    set_attention(module, NAME)
    param = next(module.parameters())
    dtype = dtype or param.dtype
    if param.is_cuda and dtype in (torch.bfloat16, torch.float16):
        config = module.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        _flash_self_test(param.device, dtype, head_dim)
        _torch_varlen(head_dim, head_dim ** -0.5)  # the key its layers will ask for, resolved outside any compile
    return lambda: set_attention(module, current)


def _flash_self_test(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Run torch's varlen kernel forward and backward once on two tiny sequences, so a kernel
    this GPU or build cannot run is found before training (``_FLASH_FAILED``), not mid-backward."""
    flash = _torch_varlen(head_dim, None)
    if flash is None or _FLASH_FAILED:
        return
    try:
        q, k, v = (torch.randn(5, 2, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
        flash(q, k, v, cu, 3, head_dim ** -0.5, 1).sum().backward()
    except RuntimeError as e:
        _flash_failed(e)
