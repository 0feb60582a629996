"""Engine base classes: one model shard on one device, for one of three roles.

* ``InferEngine``: per-token logprobs (causal LM), per-token values (value head) or
  sequence scores (reward head), without gradients.
* ``TrainEngine``: an ``InferEngine`` that also runs forward/backward with gradient
  accumulation, an optimizer step, and saves in HF format.
* ``GenerateEngine``: batched sampling that returns token ids and their logprobs, and takes
  new weights.

Engines never import Ray: the coordinator hosts them in Ray actors and tells each its rank.
Backends register by name (``@ENGINES.register("hf")``) or are named in YAML by import path
``pkg.mod:Class``. See docs/extending.md.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Protocol

import torch

from xrlhf.data.batch import Batch
from xrlhf.utils.registry import Registry

if TYPE_CHECKING:
    from xrlhf.weight_sync import Message, Transport

ENGINES: Registry[type] = Registry("engine")

Head = Literal["causal_lm", "value", "score"]
"""What the model computes: next-token logits, a value per token, or one score per sequence."""

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class DistInfo:
    """Where this engine sits in its data-parallel group."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"

    def init_process_group(self) -> None:
        """Join the default torch.distributed group of this handle's ranks (idempotent)."""
        import torch.distributed as dist

        if self.world_size <= 1 or dist.is_initialized():
            return
        os.environ.setdefault("MASTER_ADDR", self.master_addr)
        os.environ.setdefault("MASTER_PORT", str(self.master_port))
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size,
                                init_method=f"tcp://{self.master_addr}:{self.master_port}")


@dataclass
class EngineSpec:
    """Everything an engine needs to build itself; made by the coordinator from YAML.

    Args:
        model_path: a local HF-format directory.
        head: what the model computes (see ``Head``).
        device: ``"cpu"`` or ``"cuda"`` (the worker's visible GPU).
        dtype: ``"float32"`` or ``"bfloat16"``.
        options: the engine's own YAML block (train / infer / generate section as a dict).
        dist: the data-parallel group.
        seed: the base seed; engines offset it by rank where sampling must differ.
    """

    model_path: str
    head: Head = "causal_lm"
    device: str = "cpu"
    dtype: str = "float32"
    options: dict[str, Any] = field(default_factory=dict)
    dist: DistInfo = field(default_factory=DistInfo)
    seed: int = 0
    temperature: float = 1.0


@dataclass
class ForwardOutput:
    """What a train/infer forward returns for the response part of a batch.

    Attributes:
        logprobs: ``[B, R]`` logprob of each response token (causal LM head), else ``None``.
        entropy: ``[B, R]`` entropy of the next-token distribution, when asked for.
        values: ``[B, R]`` value of the state before each response token (value head).
        scores: ``[B]`` one score per sequence (score head).
    """

    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None


class LossFn(Protocol):
    """A loss given to ``TrainEngine.train_step``; built by an algorithm from pure functions.

    ``__call__`` returns the *sum* of the loss over the micro-batch's units and metrics
    (each a mean over the micro-batch). The engine divides by the number of units in the
    whole global mini-batch (all ranks), so gradients do not depend on how the batch was
    split across ranks and micro-batches.

    Attributes:
        unit: ``"token"`` (units are ``response_mask`` ones) or ``"sequence"`` (rows).
        needs_entropy: whether the forward must compute the entropy.
    """

    unit: Literal["token", "sequence"]
    needs_entropy: bool

    def __call__(self, out: ForwardOutput, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class InferEngine(ABC):
    """Computes logprobs, values or scores for a batch, without gradients."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec

    @abstractmethod
    def forward(self, batch: Batch, need_entropy: bool = False) -> ForwardOutput:
        """Forward pass over ``batch`` (with autograd enabled if the caller enables it)."""

    @torch.no_grad()
    def infer(self, batch: Batch, micro_batch_size: int = 64) -> Batch:
        """Run ``forward`` in micro-batches; returns ``logprobs``/``values`` ``[B, R]`` or ``scores`` ``[B]``."""
        outs = [self.forward(mb) for mb in batch.chunks(micro_batch_size)]
        result = {}
        for key in ("logprobs", "values", "scores"):
            parts = [getattr(o, key) for o in outs]
            if parts and parts[0] is not None:
                result[key] = torch.cat(parts).float().cpu()
        return Batch(result)

    def offload(self) -> None:
        """Release accelerator memory between phases (co-located layouts). Default: nothing."""

    def reload(self) -> None:
        """Undo ``offload``. Default: nothing."""


class TrainEngine(InferEngine):
    """An ``InferEngine`` that also trains: micro-batch accumulation, DP sync, optimizer step."""

    collective_weights: bool = False
    """Whether ``named_weights`` is a collective (sharded weights, e.g. ZeRO-3): then every rank
    of the group must iterate it, in step, even where only rank 0 uses the tensors."""

    @abstractmethod
    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's share of a global mini-batch.

        Splits ``batch`` into micro-batches, accumulates gradients, all-reduces them across
        the data-parallel group, clips, steps the optimizer and the LR schedule.

        Returns:
            metrics averaged over the micro-batches (``loss``, ``grad_norm``, ``lr`` and the
            loss function's own).
        """

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights, tensor by tensor (gathered if sharded), in HF naming."""

    @abstractmethod
    def save_pretrained(self, path: str) -> None:
        """Write the model (and tokenizer) in HF format, loadable by ``from_pretrained``."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and scheduler state, for exact resume.

        Called on every rank. A replicated engine returns the same on each; a sharded one
        returns its share under ``"shard_files"`` (see ``merge_rank_states``).
        """

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


def merge_rank_states(states: list[Any]) -> Any:
    """One state every rank can load, from each rank's ``TrainEngine.state_dict()``.

    Replicated engines: rank 0's. Sharded engines (DeepSpeed ZeRO) return
    ``{"shard_files": {name: bytes}, ...}``; the result holds the union of all ranks' files.
    """
    first = states[0]
    if not (isinstance(first, dict) and "shard_files" in first):
        return first
    files: dict[str, Any] = {}
    for s in states:
        files.update(s["shard_files"])
    return {**first, "shard_files": files}


@dataclass
class SamplingParams:
    """How a generate engine samples; the same fields for every backend.

    ``temperature == 0`` means greedy. ``logprobs`` returned are of the temperature-scaled
    distribution before top-p/top-k truncation: the distribution the trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class GenerationOutput:
    """Generated continuations: ``B`` lists of token ids and their sampling logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]


class GenerateEngine(ABC):
    """Samples continuations of token-id prompts and accepts new weights.

    Attributes:
        shares_trainer_process: the weights live in the process that hosts the engine (so a
            co-located trainer can hand tensors over as they are: transport ``in_process``).
    """

    shares_trainer_process: bool = True

    def __init__(self, spec: EngineSpec):
        self.spec = spec

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        """Sample one continuation per prompt (truncated after the first stop token, kept)."""

    @abstractmethod
    def update_weights(self, weights: NamedTensors) -> None:
        """Load new weights (HF names) into the generator."""

    def receive_weights(self, transport: "Transport", messages: "list[Message] | None" = None) -> int:
        """Receive new weights through ``transport`` and load them; returns the tensor count.

        ``messages`` are a message transport's buckets; a broadcast transport (``None``) pulls
        its buckets from its collective. The default receives in this process; an engine whose
        weights live in another process (vLLM) receives there, so checksums are checked
        where the tensors land.
        """
        n = 0
        for named in transport.receive_all(messages, self.spec.device):
            self.update_weights(named)
            n += len(named)
        return n

    def end_sync(self) -> None:
        """Called once the last bucket of a sync is loaded: ready the engine to generate."""
        self.wake_up()

    def weight_checksums(self) -> dict[str, int]:
        """``weight_sync.checksum`` of every weight as loaded, by HF name (for verification)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read its weights back")

    def sleep(self) -> None:
        """Release accelerator memory while training runs (co-located layouts). Default: nothing."""

    def wake_up(self) -> None:
        """Undo ``sleep``. Default: nothing."""

    def shutdown(self) -> None:
        """Free the engine's resources now (processes, GPU memory). Default: nothing."""


def build_engine(name: str, spec: EngineSpec, role: Literal["train", "infer", "generate"]):
    """Instantiate the engine registered as ``name`` (or import path) for ``role``.

    A backend registers one class per role under ``"<name>"`` with ``ROLE_SUFFIX``: e.g. the
    Transformers backend registers ``hf.train``, ``hf.infer`` and ``hf.generate``. An import
    path names the class itself.
    """
    _import_backend(name)
    key = name if ":" in name else f"{name}.{role}"
    if ":" not in name and key not in ENGINES:
        raise KeyError(f"no {role} engine {name!r}; valid: {', '.join(engine_names(role))} "
                       f"(or an import path 'pkg.module:Class')")
    cls = ENGINES.get(key)
    base = {"train": TrainEngine, "infer": InferEngine, "generate": GenerateEngine}[role]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise KeyError(f"{name!r} is not a {base.__name__} subclass")
    return cls(spec)


BUILTIN_BACKENDS: dict[str, str] = {
    "hf": "xrlhf.engines.hf",
    "deepspeed": "xrlhf.engines.deepspeed",
    "vllm": "xrlhf.engines.vllm",
}
"""Built-in backends, imported lazily so that vLLM/DeepSpeed load only when chosen."""

_EXTRAS = {"deepspeed": "deepspeed", "vllm": "gpu"}


def _import_backend(name: str) -> None:
    import importlib

    importlib.import_module(BUILTIN_BACKENDS["hf"])
    if name in BUILTIN_BACKENDS and name != "hf":
        try:
            importlib.import_module(BUILTIN_BACKENDS[name])
        except ImportError as e:
            raise KeyError(f"engine {name!r} needs a package that is not installed ({e}); "
                           f"install it with: pip install -e '.[{_EXTRAS[name]}]'") from None


def engine_names(role: str) -> list[str]:
    """Names that ``build_engine`` accepts for ``role`` (registered, plus lazily loaded built-ins)."""
    _import_backend("hf")
    names = {n.split(".")[0] for n in ENGINES.names() if n.endswith("." + role)}
    lazy = {"train": {"deepspeed"}, "infer": {"deepspeed"}, "generate": {"vllm"}}[role]
    return sorted(names | lazy)
