"""``hf.generate``: sampling with a Transformers model, keyed or not (see the class).

The generate engine samples with ``model.generate`` on torch's global RNG, or, given a seed per
prompt, with the keyed decode loop of ``engines.hf.decode`` (a generator per row; weights may
change between two tokens of a running call).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from xrlhf.engines.base import (ENGINES, EngineSpec, GenerateEngine, GenerateOptions, GenerationOutput, NamedTensors,
                                SamplingParams)
from xrlhf.engines.hf.decode import StepHook, WeightGate, decode_keyed
from xrlhf.engines.hf.model import HFModel, build_imports, token_logprobs

if TYPE_CHECKING:
    from xrlhf.weight_sync import Message, Transport


def load_named_weights(model: torch.nn.Module, weights: NamedTensors) -> int:
    """Copy ``(name, tensor)`` pairs into ``model`` in place; unknown names raise. Returns the count."""
    params = model.state_dict(keep_vars=True)
    n = 0
    with torch.no_grad():
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of the generator")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            n += 1
    return n


class HFGenerateOptions(GenerateOptions):
    """``policy.generate`` of the Transformers generate engine."""

    micro_batch_size: int = Field(256, ge=1, description="hf: prompts per generate call")


@ENGINES.register("hf.generate")
class HFGenerateEngine(GenerateEngine):
    """Sampling with a Transformers model; logprobs of the temperature-scaled distribution.

    Two paths. Unkeyed (``seeds=None``): ``model.generate`` on torch's global RNG, seeded per
    call from ``params.seed`` or the spec's seed and rank plus a call count (``rng_state``); the
    quickstart's numbers depend on it, so it stays as it is, one call at a time. Keyed (``seeds``
    given): ``engines.hf.decode.decode_keyed``, one generator per row, so a row depends only on its seed,
    its prompt and the weights (see that module for what is bit-exact).

    Concurrency: every call may come from its own thread. ``self.gate`` (``engines.hf.decode.WeightGate``)
    serialises the model's use: a keyed call holds it for one token step at a time, an unkeyed
    call for the whole call (it owns the global RNG meanwhile), a weight load for the copy. A sync
    (``receive_weights`` ... ``end_sync``) pauses the keyed calls at a token boundary from its
    first bucket to its end, so each token is sampled by one whole set of weights, stamped with
    its version; ``SamplingParams.on_update`` says what a call does with its unfinished rows.

    Attributes:
        step_hook: a test seam: called with the step index before each token step of a keyed
            call, outside the gate (a test runs a sync there to land it at a known token).
    """

    Options = HFGenerateOptions
    pauses_mid_generation = True
    logprobs_are_free = True  # the decode loop has the distribution at hand

    fork_imports = staticmethod(build_imports)  # Engine.fork_imports

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        self.hf = HFModel(self.spec)
        self.model = self.hf.model.eval().requires_grad_(False)
        cfg = self.model.config
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.eos_ids = _as_list(getattr(self.model.generation_config, "eos_token_id", None) or cfg.eos_token_id)
        self._calls = 0
        self.gate = WeightGate()
        self.step_hook: StepHook | None = None

    @property
    def version(self) -> int:  # type: ignore[override]
        return self.gate.version

    @version.setter
    def version(self, value: int) -> None:
        self.gate.version = value

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> GenerationOutput:
        """``B`` continuations in micro-batches of ``options.micro_batch_size`` prompts: keyed
        (``decode_keyed``, one seed per prompt) or not (``model.generate``); see the class."""
        if seeds is None:
            out = self._generate_unkeyed(prompts, params)
            return out if params.logprobs else dataclasses.replace(out, logprobs=[])  # the contract of base.py
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt")
        mbs = self.options.micro_batch_size
        stop = params.stop_token_ids or self.eos_ids
        out = GenerationOutput([], [], [])
        for start in range(0, len(prompts), mbs):
            part = decode_keyed(self.model, prompts[start:start + mbs], seeds[start:start + mbs], params,
                                self.gate, self.pad_id, stop, self.step_hook)
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs
            out.versions += part.versions
        return out if params.logprobs else dataclasses.replace(out, logprobs=[])

    def _generate_unkeyed(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        mbs = self.options.micro_batch_size
        token_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        with self.gate.step():  # the global RNG and the weights are this call's until it returns
            seed = params.seed if params.seed is not None else self.spec.seed * 100003 + self.spec.dist.rank * 7919
            torch.manual_seed(seed + self._calls)
            self._calls += 1
            for start in range(0, len(prompts), mbs):
                ids, lps = self._generate_chunk(prompts[start:start + mbs], params)
                token_ids += ids
                logprobs += lps
            version = self.version
        return GenerationOutput(token_ids, logprobs, [[version] * len(t) for t in token_ids])

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        stop = params.stop_token_ids or self.eos_ids
        greedy = params.temperature <= 0
        out = self.model.generate(
            input_ids=ids.to(self.hf.device), attention_mask=attn.to(self.hf.device),
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p, top_k=params.top_k or None,
            max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens if params.ignore_eos else 0,
            eos_token_id=None if params.ignore_eos else stop, pad_token_id=self.pad_id,
            output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1)[:, :new.shape[1]]
        lp = token_logprobs(logits, new.to(logits.device), params.temperature).cpu()
        return _truncate(new, lp, set(stop), params.ignore_eos)

    def update_weights(self, weights: NamedTensors) -> None:
        """Load ``weights``; waits for the running token step, if any (a direct call changes the
        weights of running keyed calls between two tokens but not their version)."""
        with self.gate.load():
            load_named_weights(self.model, weights)

    def receive_weights(self, transport: Transport, messages: list[Message] | None = None) -> int:
        """A bucket of a sync; the first pauses the keyed calls until ``end_sync``.

        A bucket that raises ends the pause: the run stops on the error, and the calls under
        way finish (on partly loaded weights, stamped with the old version) instead of hanging."""
        self.gate.pause()
        try:
            return super().receive_weights(transport, messages)
        except BaseException:
            self.gate.resume()
            raise

    def end_sync(self, version: int | None = None) -> None:
        """Set the version and let the paused calls sample on, by their ``on_update``."""
        self.gate.resume(version)
        self.wake_up()

    def rng_state(self) -> dict[str, Any]:
        return {"calls": self._calls}  # the seed of a call is a function of this count

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self._calls = state.get("calls", self._calls)

    def weight_checksums(self) -> dict[str, int]:
        from xrlhf.weight_sync import checksums_by_name

        return checksums_by_name(self.model.state_dict().items())


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]


def _truncate(tokens: torch.Tensor, logprobs: torch.Tensor, stop: set[int], ignore_eos: bool):
    """Cut each row after its first stop token (kept); ``[B, N]`` -> lists."""
    ids_out, lps_out = [], []
    for row, lps in zip(tokens.tolist(), logprobs.tolist()):
        end = len(row)
        if not ignore_eos:
            for j, t in enumerate(row):
                if t in stop:
                    end = j + 1
                    break
        ids_out.append(row[:end])
        lps_out.append(lps[:end])
    return ids_out, lps_out
