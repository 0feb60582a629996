"""The keyed decode loop of the Transformers generate engine, and the gate that lets new weights
land between its tokens.

Why not ``model.generate`` here: it samples from torch's process-global RNG, so a row's tokens
depend on the other rows of the call, on the micro-batch split and on any other thread drawing
from that RNG meanwhile. Asynchronous rollout (docs/design/async-rl.md §3.3) needs a row to be a
function of (seed, prompt, weights) only, the basis of regenerating a batch exactly on resume,
and needs weights to change between two tokens of a running call (the CPU twin of vLLM's
pause/keep, §3.4). So this loop samples row ``i`` from its own ``torch.Generator`` and samples
one token per *step*; a step (forward + sampling) runs inside ``WeightGate.step``, so a weight
load happens between two steps, never inside one.

What is bit-exact: a row's random draws (its generator is seeded from its seed alone and draws
the same amount at each step), hence its tokens whenever its logits are. Its logits are bit-exact
across batch compositions only where the backend's kernels are: on CPU float32 a forward of a row
in another batch (other rows, other padding, another micro-batch size) may differ by float
rounding (~1e-7), so sampled tokens agree unless a draw falls within that distance of a
boundary of the CDF (or greedy meets a near-tie), and logprobs agree to ~1e-6.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from xrlhf.engines.base import GenerationOutput, SamplingParams
from xrlhf.utils.seeds import derive_seed

def filter_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Scores outside the ``k`` highest of each row set to -inf: ``[N, V] -> [N, V]``.

    transformers' ``TopKLogitsWarper`` (min_tokens_to_keep 1): ties with the k-th are kept."""
    k = min(max(k, 1), scores.size(-1))
    return scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))


def filter_top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: ``[N, V] -> [N, V]``, transformers' ``TopPLogitsWarper`` (min_tokens_to_keep 1).

    Sorted ascending, the tokens whose cumulative probability is ``<= 1 - p`` go; the most
    likely token always stays."""
    sorted_scores, sorted_idx = torch.sort(scores, descending=False)
    remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - p)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: ``logits [N, V]`` (raw) -> ``tokens [N]``, ``logprobs [N]``.

    As ``model.generate`` samples: logits / temperature, then top-k, then top-p, then a draw;
    greedy (argmax of the raw logits) when ``temperature <= 0``. Row ``i`` draws with
    ``generators[i]`` only (``torch.multinomial`` of one sample: an exponential race over the
    ``V`` entries, so each step draws the same amount). ``logprobs`` are of the temperature-scaled
    distribution before top-k/top-p (``hf.token_logprobs``; temperature 1 when greedy).
    """
    logits = logits.float()
    t = params.temperature
    scaled = logits / t if t > 0 else logits
    if t <= 0:
        tokens = logits.argmax(-1)
    else:
        kept = scaled
        if params.top_k:
            kept = filter_top_k(kept, params.top_k)
        if params.top_p < 1.0:
            kept = filter_top_p(kept, params.top_p)
        probs = kept.softmax(-1)
        tokens = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
    logprobs = F.log_softmax(scaled, -1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs


class WeightGate:
    """Lets weights change between the token steps of running calls, never inside one.

    One condition: its lock is held by a step (one forward + sampling of a call), by a weight
    load and by ``resume``; ``paused`` holds steps back between a sync's first bucket and its end.
    Nothing is owned by a thread (a broadcast transport receives in a thread of its own while
    ``end_sync`` comes from the host's), and nobody holds the lock while waiting for another
    party, so a sync with no generation running, a sync from another thread mid-generation and
    one from inside a call's ``step_hook`` all go through.

    Attributes:
        version: the policy version of the loaded weights; read by a step to stamp its tokens.
        epoch: counts weight loads; a call sees its weights changed when it differs from the
            value its previous step saw (this also catches a direct ``update_weights`` or a
            failed sync, which change weights without a new version).
        paused: a sync is under way: no step starts until ``resume``.
        held: how many steps wait for the sync to end.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.version = 0
        self.epoch = 0
        self.paused = False
        self.held = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Wait until no sync is under way, then hold the model for one step."""
        with self._cond:
            if self.paused:
                self.held += 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: not self.paused)
                self.held -= 1
            yield

    def wait_held(self, n: int = 1, timeout: float | None = None) -> bool:
        """Wait until ``n`` steps are held back by a sync (tests; a sync itself never waits for it)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.held >= n, timeout)

    @contextmanager
    def load(self) -> Iterator[None]:
        """Hold the model while weights are copied in (no step runs), then count a new epoch
        (also when the copy raises part-way: some weights may have changed)."""
        with self._cond:
            try:
                yield
            finally:
                self.epoch += 1

    def pause(self) -> None:
        """A sync begins (idempotent: every bucket calls it): wait for the running step, hold the rest."""
        with self._cond:
            self.paused = True

    def resume(self, version: int | None = None) -> None:
        """A sync ends (or failed): set ``version`` (``None``: unchanged) and let steps run."""
        with self._cond:
            if version is not None:
                self.version = version
            self.paused = False
            self._cond.notify_all()


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the KV cache in ``model``'s forward and outputs: ``cache`` from transformers
    5.24 (``past_key_values`` still works there but warns, and leaves in 5.40), else
    ``past_key_values``. Read from the forward's public signature, once per class."""
    cls = type(model)
    if cls not in _CACHE_ARGUMENT:
        _CACHE_ARGUMENT[cls] = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return _CACHE_ARGUMENT[cls]


_CACHE_ARGUMENT: dict[type, str] = {}


@dataclass
class _Rows:
    """The unfinished rows of one micro-batch while they decode (``N`` rows, width ``L``).

    Attributes:
        index: ``N`` positions of the rows in the call's output.
        ids: ``[N, L]`` left-padded prompts followed by the tokens sampled so far.
        attn: ``[N, L]`` 1 on real tokens, 0 on the left padding.
        gens: ``N`` generators, one per row.
        cache: the KV cache of ``ids[:, :L - pending]`` (``None``: empty).
        pending: how many trailing columns of ``ids`` the next forward feeds.
    """

    index: list[int]
    ids: torch.Tensor
    attn: torch.Tensor
    gens: list[torch.Generator]
    cache: Any = None
    pending: int = 0

    @classmethod
    def start(cls, prompts: list[list[int]], seeds: list[int], index: list[int], pad_id: int,
              device: torch.device) -> "_Rows":
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        return cls(index, ids.to(device), attn.to(device), gens, None, width)

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        """Feed the pending columns through ``model``, extending the cache: ``-> [N, V]`` the
        logits of the next token. Position ids count real tokens (as ``HFModel.forward``)."""
        pos = (self.attn.cumsum(-1) - 1).clamp(min=0)
        name = cache_argument(model)
        out = model(input_ids=self.ids[:, -self.pending:], attention_mask=self.attn,
                    position_ids=pos[:, -self.pending:], use_cache=True, logits_to_keep=1, **{name: self.cache})
        self.cache, self.pending = getattr(out, name), 0
        return out.logits[:, -1]

    def append(self, tokens: torch.Tensor) -> None:
        """Add ``tokens [N]`` as the next column (fed by the next forward)."""
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        self.attn = torch.cat([self.attn, torch.ones_like(self.attn[:, :1])], dim=1)
        self.pending += 1

    def keep(self, rows: list[int]) -> None:
        """Keep only the rows at positions ``rows`` (the others finished)."""
        sel = torch.tensor(rows, dtype=torch.long, device=self.ids.device)
        self.index = [self.index[r] for r in rows]
        self.ids, self.attn = self.ids[sel], self.attn[sel]
        self.gens = [self.gens[r] for r in rows]
        if self.cache is not None:
            self.cache.batch_select_indices(sel)


StepHook = Callable[[int], None]
"""Called with the step index (tokens sampled so far in the attempt) before each step, outside
the gate: a test seam where a sync may run."""


def decode_keyed(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
                 gate: WeightGate, pad_id: int, stop_ids: list[int],
                 step_hook: StepHook | None = None) -> GenerationOutput:
    """Sample one continuation per prompt, row ``i`` from a generator seeded with ``seeds[i]``.

    Rows end at a stop token (``stop_ids``, kept; none when ``params.ignore_eos``) or after
    ``params.max_new_tokens``; a finished row leaves the batch. Each token is stamped with
    ``gate.version`` as of the step that sampled it. When the weights change between two steps
    (``gate.epoch``), ``params.on_update`` says what the unfinished rows do: ``continue`` (keep
    the KV cache of the old weights), ``recompute`` (feed prompt + tokens so far through the new
    weights to rebuild it before the next token), ``abort`` (restart from the prompt with seed
    ``derive_seed(seeds[i], attempt)``, attempt counting the row's restarts, so every token of a
    row has one version).

    Returns:
        ``B`` lists of token ids, their logprobs and their versions.
    """
    n = len(prompts)
    out = GenerationOutput([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
    attempts = [0] * n
    todo = list(range(n))
    while todo:
        rows = _Rows.start([prompts[i] for i in todo], [derive_seed(seeds[i], attempts[i]) for i in todo], todo,
                           pad_id, next(model.parameters()).device)
        todo = _decode_attempt(model, rows, params, gate, set() if params.ignore_eos else set(stop_ids),
                               out, step_hook)
        for i in todo:
            attempts[i] += 1
            out.token_ids[i], out.logprobs[i], out.versions[i] = [], [], []
    return out


def _decode_attempt(model: torch.nn.Module, rows: _Rows, params: SamplingParams, gate: WeightGate,
                    stop: set[int], out: GenerationOutput, step_hook: StepHook | None) -> list[int]:
    """Decode ``rows`` into ``out`` until they finish; returns the rows an update aborted."""
    epoch = None
    for step in range(params.max_new_tokens):
        if step_hook is not None:
            step_hook(step)
        with gate.step():
            if epoch is not None and gate.epoch != epoch:
                if params.on_update == "abort":
                    return rows.index
                if params.on_update == "recompute":
                    rows.cache, rows.pending = None, rows.ids.shape[1]
            epoch, version = gate.epoch, gate.version
            tokens, logprobs = sample_next(rows.forward(model), params, rows.gens)
        rows.append(tokens)
        unfinished = []
        for j, (i, t, lp) in enumerate(zip(rows.index, tokens.tolist(), logprobs.tolist())):
            out.token_ids[i].append(t)
            out.logprobs[i].append(lp)
            out.versions[i].append(version)
            if t not in stop:
                unfinished.append(j)
        if not unfinished:
            break
        if len(unfinished) < len(rows.index):
            rows.keep(unfinished)
    return []
