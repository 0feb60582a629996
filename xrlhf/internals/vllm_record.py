"""Sampled tokens' logprobs kept on the GPU inside vLLM's worker, fetched once per call
(``policy.generate.logprobs_path: worker``; the hook ``vllm.worker_logprobs``).

Why. Asked for ``logprobs=0``, vLLM moves each sampled token's logprob to the host at every
step, slices it per request in its scheduler, encodes it in every request's output for the
client, and appends it there to a Python container per request: host work per request per step
on a model whose decoding is bound by host work (docs/design/generation-speed.md). Here the
requests ask vLLM for no logprobs; the worker's sampler computes the sampled token's logprob with
vLLM's own kernel from the same processed logits (``processed_logprobs``: after temperature and
top-k/top-p) and scatters it into a ``[slots, width]`` buffer on the GPU: a few kernel launches
per step, nothing per request. When a call's requests have finished, the engine takes their rows
in one RPC.

How it hooks in (vLLM's V2 model runner, ``vllm/v1/worker/gpu/``): the runner's one ``Sampler``
gets a subclass (``recording_sampler``) that overrides two methods:

* ``add_request`` (called for every request scheduled anew, a preempted one resuming included,
  after the runner's request states mapped the slot to the request id): the slot is claimed for the
  request (``LogprobRecord.claim``). 0.25 passes the prompt's length; 0.33 keeps it in
  ``req_states.prompt_len``, written before the call.
* ``sample`` (returns the sampled ids and the processed logits that vLLM's own
  ``processed_logprobs`` are computed from): the sampled token at position ``pos + 1`` gets its
  logprob written at output index ``pos + 1 - prompt_len``. 0.33 added arguments before ``pos``;
  the subclass finds ``pos`` by name in the base's signature.

Slots are reused (a freed slot is the next one taken), so a claim first moves the slot's previous
row aside, by request id, on the GPU. Every GPU operation here runs on the runner's one stream, in
the order the host issues them, so a row is moved aside after the last step that wrote it and
before the next request writes. A request preempted and resumed leaves several pieces; the later
piece wins where both wrote (the resumed request samples again the positions a discarded
in-flight step had written).

``uninstall`` gives the sampler back its own class and FlashInfer setting (kept on it by
``install``) and drops the record with whatever it held untaken; a later ``install`` starts a
fresh one.

This module imports no vLLM at module level; ``install`` does, in vLLM's worker.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from xrlhf.internals import Hook
from xrlhf.internals.vllm import CHECKED

def _sampler_hooks() -> str | None:
    from vllm.v1.worker.gpu.sample import logprob
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    sample = inspect.signature(Sampler.sample).parameters
    missing = [n for n in ("logits", "expanded_idx_mapping", "pos") if n not in sample]
    if "sampling_params" not in inspect.signature(Sampler.add_request).parameters:
        missing.append("add_request(sampling_params)")
    if not callable(getattr(logprob, "compute_token_logprobs", None)):
        missing.append("compute_token_logprobs")
    return f"vLLM's V2 sampler has no {', '.join(missing)}" if missing else None


WORKER_LOGPROBS = Hook(
    "vllm.worker_logprobs", "vllm", CHECKED,
    buys="sampled tokens' logprobs stay on the GPU in vLLM's worker and are taken once per call "
         "(logprobs_path: worker), instead of per request and step through vLLM's outputs",
    without="logprobs come through vLLM's outputs (logprobs_path: outputs)",
    probe=_sampler_hooks)

MAX_SAVED_PER_SLOT = 8
"""Rows moved aside and never taken (a call that failed) are dropped oldest first beyond this
many per slot, so a long run cannot accumulate them."""


def external_id(internal: str) -> str:
    """The request id the caller gave, from the id vLLM's worker sees: vLLM appends ``-`` and 8
    random characters unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set
    (``v1/engine/input_processor.py``)."""
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0"):
        return internal
    return internal.rsplit("-", 1)[0]


class LogprobRecord:
    """The logprob of every sampled token, by request slot and output index, on the device.

    ``buf`` ``[slots, width + 1]`` float32, NaN where nothing was written; column ``width``
    takes the writes that belong to no output index (a prefill chunk's discarded sample, an
    in-flight step past a request's end). ``prompt_len`` ``[slots]`` on the device.

    Args:
        slots: vLLM's ``max_num_reqs`` (requests decoded at once).
        device: where the logits are.
        width: output tokens per request to start with (grows with the requests' ``max_tokens``).
    """

    def __init__(self, slots: int, device: torch.device | str, width: int = 16):
        self.slots = slots
        self.device = torch.device(device)
        self.width = 0
        self.buf = torch.full((slots, 1), float("nan"), device=self.device)
        self.prompt_len = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.owner: list[str | None] = [None] * slots
        self.slot_of: dict[str, int] = {}
        self.saved: dict[str, list[torch.Tensor]] = {}
        self.dropped = 0
        """Rows moved aside and dropped untaken (``MAX_SAVED_PER_SLOT``)."""
        self._grow(width)

    def _grow(self, width: int) -> None:
        if width <= self.width:
            return
        buf = torch.full((self.slots, width + 1), float("nan"), device=self.device)
        buf[:, :self.width] = self.buf[:, :self.width]
        self.buf, self.width = buf, width

    def claim(self, slot: int, key: str, prompt_len: int, max_tokens: int) -> None:
        """Slot ``slot`` now holds request ``key`` (prompt of ``prompt_len`` tokens, at most
        ``max_tokens`` new ones); what the slot held before is moved aside under its request."""
        self._release(slot)
        if key in self.slot_of:  # resumed after a preemption into another slot: its old piece first
            self._release(self.slot_of[key])
        self._grow(max_tokens)
        self.buf[slot].fill_(float("nan"))
        self.prompt_len[slot] = prompt_len
        self.owner[slot] = key
        self.slot_of[key] = slot

    def _release(self, slot: int) -> None:
        key = self.owner[slot]
        if key is None:
            return
        self.saved.setdefault(key, []).append(self.buf[slot, :self.width].clone())
        self.owner[slot] = None
        del self.slot_of[key]
        if len(self.saved) > MAX_SAVED_PER_SLOT * self.slots:
            oldest = next(iter(self.saved))
            self.dropped += len(self.saved.pop(oldest))

    def write(self, logprobs: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Record one step: ``logprobs`` ``[N]`` of the tokens sampled for ``slots`` ``[N]`` at
        absolute ``positions`` ``[N]`` (prompt and output counted together)."""
        slots = slots.long()
        col = positions.long() - self.prompt_len[slots]
        col = torch.where((col >= 0) & (col < self.width), col, torch.full_like(col, self.width))
        self.buf.index_put_((slots, col), logprobs.to(torch.float32))

    def forget(self, keys: list[str]) -> None:
        """Drop what is kept for ``keys`` (requests aborted or restarted: never taken)."""
        for key in keys:
            self.saved.pop(key, None)
            slot = self.slot_of.pop(key, None)
            if slot is not None:
                self.owner[slot] = None

    def take(self, keys: list[str], lengths: list[int]) -> torch.Tensor:
        """The first ``lengths[i]`` logprobs of request ``keys[i]``, concatenated on the host
        (float32, ``sum(lengths)``), and forgotten here. Every request must have finished.

        Raises:
            RuntimeError: a request is unknown or a token of it has no logprob (the record missed it).
        """
        if not keys:
            return torch.zeros(0)
        rows = []
        for key, n in zip(keys, lengths, strict=True):
            pieces = self.saved.pop(key, [])
            slot = self.slot_of.pop(key, None)
            if slot is not None:
                pieces.append(self.buf[slot, :self.width])
                self.owner[slot] = None
            if not pieces or n > self.width:
                raise RuntimeError(f"logprobs_path worker: no record of {n} tokens for request {key!r}"
                                   + (f" ({self.dropped} rows dropped untaken)" if self.dropped else ""))
            row = torch.full((self.width,), float("nan"), device=self.device)
            for p in pieces:  # later pieces win: a resumed request samples again what a stale step wrote
                row[:p.numel()] = torch.where(torch.isnan(p), row[:p.numel()], p)
            rows.append(row)
        host = torch.stack(rows).cpu()
        mask = torch.arange(self.width) < torch.tensor(lengths).unsqueeze(1)
        out = host[mask]  # row-major: request by request, in order
        if torch.isnan(out).any():
            i = int(torch.isnan(host).logical_and(mask).any(1).nonzero()[0])
            raise RuntimeError(f"logprobs_path worker: request {keys[i]!r} has tokens without a recorded logprob")
        return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[N]`` log softmax of ``logits`` ``[N, V]`` at ``tokens`` ``[N]``: vLLM's own kernel on a
    GPU (``sample/logprob.py``: no ``[N, V]`` logprob tensor is made), torch elsewhere."""
    if logits.is_cuda:
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

        return compute_token_logprobs(logits, tokens.view(-1, 1))[:, 0]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.view(-1, 1).long())[:, 0]


def recording_sampler(base: type) -> type:
    """``base`` (vLLM's V2 ``Sampler``) with the two overrides of the module docstring, for the
    signatures of 0.25 (``add_request(req_idx, prompt_len, sampling_params)``, ``sample(logits,
    expanded_idx_mapping, idx_mapping_np, pos, ...)``) and 0.33 (``add_request(req_idx,
    sampling_params)``, ``sample(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, ...)``)."""
    sample_args = list(inspect.signature(base.sample).parameters)[1:]  # without self
    passes_prompt_len = "prompt_len" in inspect.signature(base.add_request).parameters

    class RecordingSampler(base):
        _xrlhf_record: LogprobRecord

        def add_request(self, req_idx: int, *args, **kwargs) -> None:
            super().add_request(req_idx, *args, **kwargs)
            params = kwargs.get("sampling_params", args[-1] if args else None)
            if passes_prompt_len:
                prompt_len = kwargs.get("prompt_len", args[0] if args else None)
            else:
                prompt_len = self.req_states.prompt_len.np[req_idx]
            key = external_id(self.req_states.index_to_req_id[req_idx])
            self._xrlhf_record.claim(req_idx, key, int(prompt_len), int(params.max_tokens or 0))

        def sample(self, *args, **kwargs):
            sampled, processed = super().sample(*args, **kwargs)
            bound = dict(zip(sample_args, args), **kwargs)
            self._xrlhf_record.write(token_logprobs(processed, sampled), bound["expanded_idx_mapping"],
                                     bound["pos"] + 1)
            return sampled, processed

    RecordingSampler.__name__ = RecordingSampler.__qualname__ = f"Recording{base.__name__}"
    return RecordingSampler


def install(runner: Any, device: torch.device, base: type | None = None) -> LogprobRecord:
    """Make ``runner``'s sampler record; returns its record. ``base``: the sampler class expected
    (default vLLM's V2 ``Sampler``, where the hook is on; tests give their own).

    Raises:
        RuntimeError: the hook is off, the runner is not the V2 one, or decodes speculatively
            (several tokens per request and step go through another sampler).
    """
    if base is None:
        if not WORKER_LOGPROBS.active():
            raise RuntimeError("policy.generate.logprobs_path: 'worker' needs the hook vllm.worker_logprobs, which is "
                               "off here (xrlhf hooks says why); set logprobs_path: outputs")
        try:
            from vllm.v1.worker.gpu.sample.sampler import Sampler as base
        except ImportError:  # pragma: no cover - a vLLM without the V2 runner
            base = type(None)
    sampler = getattr(runner, "sampler", None)
    if isinstance(getattr(sampler, "_xrlhf_record", None), LogprobRecord):
        return sampler._xrlhf_record
    if type(sampler) is not base or getattr(runner, "speculator", None) is not None:
        raise RuntimeError("policy.generate.logprobs_path: 'worker' needs vLLM's V2 model runner without speculative "
                           f"decoding (found sampler {type(sampler).__name__}); unset VLLM_USE_V2_MODEL_RUNNER or set "
                           "logprobs_path: outputs")
    sampler._xrlhf_base, sampler._xrlhf_flashinfer = base, getattr(sampler, "use_flashinfer", False)
    sampler.__class__ = recording_sampler(base)
    # vLLM's FlashInfer top-k/top-p sampler returns logits before top-k/top-p; vLLM itself turns it
    # off when processed logprobs are asked for (``sample/sampler.py``), and so does this path.
    sampler.use_flashinfer = False
    sampler._xrlhf_record = LogprobRecord(int(runner.max_num_reqs), device)
    return sampler._xrlhf_record


def uninstall(runner: Any) -> bool:
    """Undo ``install``: ``runner``'s sampler samples as vLLM's own again (its class and
    ``use_flashinfer`` as before) and its record is dropped. Returns whether it was recording.
    Call it between generations: a request running across it gets no complete record."""
    sampler = getattr(runner, "sampler", None)
    if not isinstance(getattr(sampler, "_xrlhf_record", None), LogprobRecord):
        return False
    sampler.__class__ = sampler._xrlhf_base
    sampler.use_flashinfer = sampler._xrlhf_flashinfer
    del sampler._xrlhf_record, sampler._xrlhf_base, sampler._xrlhf_flashinfer
    return True
