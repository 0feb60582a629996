"""Which layout a model's micro-batches can take, decided once by a probe when an engine is built.

``choose_path`` installs the varlen attention (``engines.hf.attention``) where it can and
probes: three short random sequences forwarded packed and padded must agree, and the packed
result of the later sequences must not change when the first one does (attention that crosses
sequences would). A model whose code ignores packing falls back to the padded layout, and says
so. ``probe_chunked`` checks likewise that the chunked logprob head gives the model's own
logprobs.

The functions take the engine's model through ``Probed`` (what ``engines.hf.model.HFModel``
offers), so this module imports nothing of the model's and the model imports it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from xrlhf.data.batch import Batch
from xrlhf.engines.base import ForwardOutput
from xrlhf.engines.hf.attention import NAME, attention_of, install_varlen, unrecorded


class Probed(Protocol):
    """What the probe reads and sets of a model (``HFModel``)."""

    module: torch.nn.Module
    device: torch.device
    attention_path: str
    logprob_chunk: int

    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None
                ) -> ForwardOutput: ...


def choose_path(hf: Probed, mode: str) -> tuple[str, str]:
    """The layout ``hf`` will forward micro-batches in, and why.

    Args:
        hf: the engine's model (placed on its device; under ZeRO-3 every rank calls this
            together: the probe's forwards are collectives).
        mode: the ``packing`` option: ``auto`` (varlen, else padded), ``varlen`` or ``masked``
            (that path or an error), ``off`` (padded).

    Returns:
        ``(path, detail)``: ``path`` one of ``varlen``, ``masked``, ``padded``.

    Raises:
        ValueError: ``varlen`` or ``masked`` asked for and the probe fails.
    """
    if mode == "off":
        return "padded", "packing: off"
    wanted = "masked" if mode == "masked" else "varlen"
    undo = install_varlen(hf.module, compute_dtype(hf)) if wanted == "varlen" else (lambda: None)
    problem = undo if isinstance(undo, str) else probe(hf, wanted)
    if problem is None:
        return wanted, _describe(hf, wanted)
    if callable(undo):
        undo()
    if mode != "auto":
        raise ValueError(f"packing: {mode} is not possible for {type(hf.module).__name__}: {problem}")
    return "padded", f"packing falls back to padded micro-batches: {problem}"


def _describe(hf: Probed, path: str) -> str:
    """What the start-up line says of the attention: what was installed. Which kernel runs is
    decided per call from the tensors, and logged at the first forward that takes it
    (``attention.TAKEN``)."""
    if path == "masked":
        return "transformers' block-diagonal mask from position ids"
    impl = attention_of(hf.module)
    return f"transformers' {impl} varlen" if impl != NAME else f"attention {NAME}"


def probe_batches(hf: Probed):
    """Two ``Batch``es of three random sequences (prompt + response lengths 3+4, 2+5, 6+1)
    that differ only in the first sequence, from a generator of their own (the global RNG,
    which a run's sampling uses, is not touched)."""
    from xrlhf.data.batch import build_sequences

    gen = torch.Generator().manual_seed(0)
    vocab = int(getattr(hf.module.config, "vocab_size", 64) or 64)
    rand = lambda n: torch.randint(3, max(4, min(vocab, 512)), (n,), generator=gen).tolist()  # noqa: E731
    seqs = [(rand(p), rand(r)) for p, r in [(3, 4), (2, 5), (6, 1)]]
    other = [(rand(3), rand(4))] + seqs[1:]
    return [build_sequences([p for p, _ in s], [r for _, r in s], pad_id=0) for s in (seqs, other)]


def compute_dtype(hf: Probed) -> torch.dtype:
    """The dtype the forward computes in: the weights' (bf16 under mixed precision too: its fp32
    masters live in the optimizer)."""
    return next(hf.module.parameters()).dtype


def _tolerance(hf: Probed) -> float:
    return 1e-4 if compute_dtype(hf) == torch.float32 else 5e-2


def probe(hf: Probed, path: str) -> str | None:
    """``None`` if ``hf`` forwards a packed micro-batch as it forwards the padded one, else why.

    The ``probe_batches`` are forwarded packed and the first padded, without gradients and in
    eval mode. The later sequences' packed outputs must not move when the first changes
    (strict: nothing but attention across sequences can move them), and packed must match
    padded (1e-4 in fp32, 5e-2 in bf16/fp16, relative to the outputs' scale).
    """
    batch, other = probe_batches(hf)
    saved = hf.attention_path
    try:
        hf.attention_path = path
        packed, packed_other = _outputs(hf, batch), _outputs(hf, other)
        hf.attention_path = "padded"
        padded = _outputs(hf, batch)
    except Exception as e:  # noqa: BLE001 - any failure of the packed forward means: do not pack
        return f"the packed forward raised {type(e).__name__}: {str(e)[:200]}"
    finally:
        hf.attention_path = saved
    crossed = (packed[1:] - packed_other[1:]).abs().max().item()
    if crossed > 1e-6 * (1 + packed[1:].abs().max().item()):
        return f"attention crosses packed sequences (a later sequence moved by {crossed:.2e})"
    diff = (packed - padded).abs().max().item()
    if diff > _tolerance(hf) * (1 + padded.abs().max().item()):
        return f"packed and padded forwards differ by {diff:.2e}"
    return None


def probe_chunked(hf: Probed, chunk: int) -> str | None:
    """``None`` if the chunked logprob head (``hf.logprob_head``) gives the logprobs of the
    model's own logits, else why: a model that changes its logits after the output layer
    (Gemma's final soft cap, Cohere's logit scale) must keep the full logits."""
    batch, _ = probe_batches(hf)
    saved = hf.logprob_chunk
    try:
        hf.logprob_chunk = 0
        full = _outputs(hf, batch)
        hf.logprob_chunk = max(1, min(chunk, 3))  # several chunks even on the probe's few tokens
        chunked = _outputs(hf, batch)
    except Exception as e:  # noqa: BLE001 - any failure means: keep the full logits
        return f"the chunked head raised {type(e).__name__}: {str(e)[:200]}"
    finally:
        hf.logprob_chunk = saved
    diff = (chunked - full).abs().max().item()
    if diff > _tolerance(hf) * (1 + full.abs().max().item()):
        return f"the model changes its logits after the output layer (chunked logprobs differ by {diff:.2e})"
    return None


def _outputs(hf: Probed, batch) -> torch.Tensor:
    """The probe's forward: eval mode, no gradients; the output on response tokens, ``[B, R]`` or ``[B, 1]``."""
    training = hf.module.training
    hf.module.eval()
    try:
        with torch.no_grad(), unrecorded():
            out = hf.forward(batch)
    finally:
        hf.module.train(training)
    if out.scores is not None:
        return out.scores.float().reshape(-1, 1)
    x = out.logprobs if out.logprobs is not None else out.values
    return x.float() * batch["response_mask"].to(x.device)  # padding columns are not compared
