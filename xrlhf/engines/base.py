"""Engine base classes: one model shard on one device, for one of three roles.

* ``InferEngine``: per-token logprobs (causal LM), per-token values (value head) or
  sequence scores (reward head), without gradients.
* ``TrainEngine``: an ``InferEngine`` that also runs forward/backward with gradient
  accumulation, an optimizer step, and saves in HF format.
* ``GenerateEngine``: batched sampling that returns token ids and their logprobs, and takes
  new weights.

Engines never import Ray: the coordinator hosts them in Ray actors and tells each its rank.

**An engine owns its options.** Each engine class has an ``Options`` pydantic model: the role's
shared section (``xrlhf.config.schema.TrainConfig`` / ``InferConfig`` / ``GenerateConfig``)
plus the backend's own fields, unknown keys rejected. ``xrlhf validate`` checks a YAML section
against the chosen engine's ``Options`` before anything starts; the engine reads typed
attributes (``self.options.lr``), so a default lives in exactly one place.

**The engine says what it can do** (class attributes and small methods, never name tests in
the coordinator): ``starts_alone_with``, ``preload``, ``workers_per_engine``,
``frees_memory_when_asleep``, ``placement_errors``, ``logprobs_are_free``, ``rng_state``; and
what ``xrlhf plan`` and ``xrlhf run``'s early fork server need (on ``Engine``, one place):
``memory_model``, ``shard_stage``, ``sharding_options``, ``sleep_levels``, ``tensor_parallel``,
``preload``. Nothing outside a backend tests its name (tests/test_backend_names.py).

**The backend table is the registry.** One module or package per backend (``hf/``,
``deepspeed/``, ``vllm/``) registers one class per role under ``"<backend>.<role>"``;
``ENGINES`` finds it by the backend's name and imports it only when that backend is named or
every name is listed, so each backend imports its heavy library (vLLM, DeepSpeed) inside the
functions that use it: validation reads every ``Options`` without vLLM or DeepSpeed installed. A class's
``requires`` (Python packages) and ``pip_extra`` say how to install what it needs. YAML names a
backend (``engine: hf``) or any subclass by import path (``engine: mypkg.engines:MyTrainer``).
See docs/extending.md. The data types engines take and return (``EngineSpec``,
``ForwardOutput``, ``LossFn``, ``SamplingParams``, ...) live in ``engines.spec``; this module
imports them, so they are reachable from here too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Literal

import torch
from pydantic import BaseModel

from xrlhf.config.schema import GenerateConfig, InferConfig, TrainConfig
from xrlhf.data.batch import Batch
from xrlhf.data.micro_batches import in_row_order, plan_micro_batches
from xrlhf.engines.spec import (DistInfo, EngineSpec, ForwardOutput, GenerationOutput, Head, LossFn,  # noqa: F401
                                NamedTensors, RolloutPlan, SamplingParams)
from xrlhf.engines.training import global_units, loss_units, max_over_ranks, unit_weighted_means
from xrlhf.utils.registry import Registry
from xrlhf.utils.versions import installed, pinned, release

if TYPE_CHECKING:
    from xrlhf.weight_sync import Message, Transport

ENGINES: Registry[type] = Registry("engine", package="xrlhf.engines")
"""Engine classes by ``"<backend>.<role>"``, found by module: ``hf.train`` is registered by the package
``xrlhf/engines/hf/``, ``deepspeed.train`` by ``xrlhf/engines/deepspeed/``."""

Role = Literal["train", "infer", "generate"]


TrainOptions = TrainConfig
"""The options of a train engine without options of its own, and the base of a backend's: the
fields every train backend shares, unknown keys rejected (``config.schema.TrainConfig``)."""
InferOptions = InferConfig
"""The options of an infer engine (``reference.infer``, ``reward.infer``); see ``TrainOptions``."""
GenerateOptions = GenerateConfig
"""The options of a generate engine (``policy.generate``); see ``TrainOptions``."""


class Engine(ABC):
    """What every engine shares: its validated options, its requirements, its RNG state.

    Attributes:
        Options: the pydantic model of the engine's YAML section (the role's shared fields
            plus the backend's own); ``self.options`` is an instance of it.
        requires: Python packages the engine imports when built (checked before anything
            starts, with ``pip_extra`` in the message).
        pip_extra: the extra of xrlhf that installs ``requires`` (``pip install -e '.[extra]'``).
    """

    Options: ClassVar[type[BaseModel]]
    requires: ClassVar[tuple[str, ...]] = ()
    pip_extra: ClassVar[str | None] = None
    supported: ClassVar[dict[str, tuple[str, ...]]] = {}
    """Package -> the ``major.minor`` releases of it the engine runs on; another is refused before
    anything starts (``version_errors``)."""
    starts_alone: ClassVar[bool] = False
    """The coordinator builds this engine before any other worker and waits for it (vLLM sizes
    its KV cache from the GPU memory it sees free while it starts). ``starts_alone_with`` says it
    for given options."""

    # What the planner (xrlhf.plan) and the fork server ask of a backend instead of its name.
    memory_model: ClassVar[str] = "replicated"
    """How ``xrlhf plan`` counts its memory: train/infer ``replicated`` or ``zero`` (partitioned as
    ``shard_stage`` says); generate ``batch`` (weights and a cache of the batch) or ``paged`` (a paged
    KV cache sized by ``gpu_memory_utilization`` or ``kv_cache_tokens``, as vLLM's)."""
    sleep_levels: ClassVar[tuple[int, ...]] = (0,)
    """The ``sleep_level`` values a generate engine takes, deepest first; ``(0,)``: it never sleeps."""
    tensor_parallel: ClassVar[bool] = False
    """One generate engine may span ``tensor_parallel_size`` GPUs."""

    @classmethod
    def shard_stage(cls, options: BaseModel) -> int:
        """How far ``options`` partition the engine over its handle's ranks, as a ZeRO stage (0: not)."""
        return 0

    @classmethod
    def sharding_options(cls, stage: int, offload: bool = False) -> dict[str, Any] | None:
        """Options partitioning it at ZeRO ``stage`` (``offload``: optimizer in CPU memory); None: cannot."""
        return None

    def __init__(self, spec: EngineSpec):
        if not isinstance(spec.options, self.Options):  # a copy: one spec may serve engines of two roles
            given = spec.options.model_dump() if isinstance(spec.options, BaseModel) else spec.options
            spec = dataclasses.replace(spec, options=self.Options.model_validate(given or {}))
        self.spec = spec
        self.options = spec.options

    @classmethod
    def starts_alone_with(cls, options: BaseModel | dict[str, Any]) -> bool:
        """Whether an engine built with ``options`` starts alone (``starts_alone`` by default)."""
        return cls.starts_alone

    @classmethod
    def preload(cls, options: BaseModel | dict[str, Any]) -> None:
        """Import what building an engine with ``options`` will import (vLLM's takes seconds), so that a
        host may run it in a thread while other engines build. Default: nothing. A class that overrides
        it gets a fork server whose forks begin with it imported, started early by ``xrlhf run``."""

    @classmethod
    def fork_imports(cls, spec: "EngineSpec") -> None:
        """Import what building an engine of ``spec`` will import, in a process whose forks become
        its workers (``coordinator.forkserver``'s plain copy, before Ray's start). Only what a
        fork keeps whole: no CUDA, no threads. Default: nothing (the worker imports it itself)."""

    @classmethod
    def missing_packages(cls) -> list[str]:
        """Packages of ``requires`` that are not installed."""
        return [p for p in cls.requires if importlib.util.find_spec(p) is None]

    @classmethod
    def version_errors(cls) -> list[str]:
        """Why the installed releases of ``supported``'s packages will not do, one line each: a
        release the engine was not checked on, or one whose exact torch pin (vLLM's) another torch
        breaks. Packages not installed are ``missing_packages``' business."""
        errors = []
        for package, releases in cls.supported.items():
            version = installed(package)
            if version is None:
                continue
            if release(version) not in {release(r) for r in releases}:
                errors.append(f"{package} {version} is not supported; it runs on {package} {' or '.join(releases)}: "
                              f"pip install -e '.[{cls.pip_extra or package}]'")
            elif (torch_pin := pinned(package, "torch")) and (torch := installed("torch")) and \
                    torch.split("+")[0] != torch_pin:
                errors.append(f"{package} {version} needs torch {torch_pin}, this is torch {torch}: "
                              f"pip install torch=={torch_pin}")
        return errors

    def rng_state(self) -> dict[str, Any]:
        """Engine-owned random state beyond torch's global generator, for exact resume."""
        return {}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore what ``rng_state`` returned."""


class InferEngine(Engine):
    """Computes logprobs, values or scores for a batch, without gradients.

    Attributes:
        device: where a backend's forward runs (the micro-batch count is all-reduced there).
        equal_micro_batches: every rank of the group must run as many forwards (and, training,
            backwards) per call, because they are collectives (DeepSpeed: ZeRO-3 gathers the
            parameters in every forward, ZeRO-2/3 reduce the gradients in every backward). With
            a token budget the ranks' micro-batch counts differ, so the templates agree on the
            largest (an all-reduce, as verl's ``same_micro_num_in_dp``) and a rank with fewer
            runs empty ones: a copy of its first rows, whose outputs count nowhere.
        packed: micro-batches run packed into one row without padding (reported as ``packed``).
    """

    Options: ClassVar[type[BaseModel]] = InferOptions
    device: torch.device = torch.device("cpu")
    equal_micro_batches: bool = False
    packed: bool = False

    @abstractmethod
    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None) -> ForwardOutput:
        """Forward pass over ``batch`` (with autograd enabled if the caller enables it); ``gather``
        ``[B, R, k]``: token ids whose logprobs the forward also returns (``ForwardOutput.gathered``;
        a backend without a causal LM head ignores it)."""

    def micro_batches(self, batch: Batch, group: int = 1, infer: bool = False
                      ) -> list[tuple[torch.Tensor | slice | None, Batch]]:
        """This rank's micro-batches of ``batch`` as ``(rows, part)``: ``micro_batch_size`` rows
        each, filled to ``max_tokens_per_micro_batch`` tokens when set
        (``data.micro_batches.plan_micro_batches``, ``group`` rows kept together); ``infer``: a
        train engine's forwards without gradients, sized by its ``infer_*`` options where set.
        ``rows`` is a slice or an index tensor into ``batch``, ``None`` for an empty micro-batch
        run only to keep the ranks in step (``equal_micro_batches``)."""
        size, budget = self.micro_batch_limits(infer)
        if budget is None:
            return [(slice(s, s + len(p)), p) for s, p in zip(range(0, len(batch), size), batch.chunks(size))]
        size = size or max(1, len(batch))
        plan = plan_micro_batches(batch["attention_mask"].sum(-1).tolist(), size, budget, group)
        parts: list[tuple[torch.Tensor | slice | None, Batch]] = [
            (idx, batch.index(idx)) for idx in map(torch.tensor, plan)]
        missing = max_over_ranks(len(parts), self.device) - len(parts) if self.equal_micro_batches else 0
        if missing > 0:
            empty = batch.index(slice(0, group))
            empty["response_mask"] = torch.zeros_like(empty["response_mask"])
            parts += [(None, empty)] * missing
        return parts

    def micro_batch_limits(self, infer: bool = False) -> tuple[int | None, int | None]:
        """``(rows, tokens)``: the most rows and tokens of one micro-batch (``None``: no cap).

        The options' ``micro_batch_size`` and ``max_tokens_per_micro_batch`` (``infer``: the
        ``infer_*`` ones where set). Where no budget is set, ``derived_budget``'s, if the backend
        derives one for its device; rows are then capped only by an ``infer_micro_batch_size``."""
        o = self.options
        explicit_infer_rows = getattr(o, "infer_micro_batch_size", None) if infer else None
        budget = getattr(o, "max_tokens_per_micro_batch", None)
        budget = (infer and getattr(o, "infer_max_tokens_per_micro_batch", None)) or budget
        if budget is None:
            derived = self.derived_budget(infer)
            if derived is not None:
                return explicit_infer_rows, derived
        return explicit_infer_rows or o.micro_batch_size, budget

    def derived_budget(self, infer: bool) -> int | None:
        """A token budget sized for the device, used where the options set none (``infer``: for
        forwards without gradients); ``None``: micro-batches of ``micro_batch_size`` rows. A backend
        that knows its memory overrides it (the ``hf`` engines on a GPU: ``engines.budget``)."""
        return None

    @torch.no_grad()
    def infer(self, batch: Batch) -> Batch:
        """``forward`` in ``micro_batches``; returns ``logprobs`` / ``values`` ``[B, R]`` or
        ``scores`` ``[B]`` on the CPU, in the rows' order."""
        outs = [(rows, self.forward(mb)) for rows, mb in self.micro_batches(batch, infer=True)]
        outs = [(rows, o) for rows, o in outs if rows is not None]
        result = {}
        for key in ("logprobs", "values", "scores", "topk_logprobs", "topk_ids"):
            parts = [(rows, getattr(o, key)) for rows, o in outs]
            if parts and parts[0][1] is not None:
                result[key] = in_row_order(parts, len(batch))
        if "topk_ids" in result:
            result["topk_ids"] = result["topk_ids"].round().long()
        return Batch(result)


class TrainEngine(InferEngine):
    """An ``InferEngine`` that also trains. ``train_step`` is a template: the micro-batch loop,
    the global-unit denominator and the unit-weighted metrics are written once, here; a backend
    implements ``backward`` and ``optimizer_step`` (and the model I/O methods).

    Attributes:
        collective_weights: whether ``named_weights`` is a collective (sharded weights, e.g.
            ZeRO-3): then every rank of the group must iterate it, in step, even where only
            rank 0 uses the tensors.
        device: where micro-batches are moved before ``forward``.
    """

    Options: ClassVar[type[BaseModel]] = TrainOptions
    collective_weights: bool = False

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's share of a global mini-batch.

        The loss of each micro-batch (a *sum* over its units) is divided by the number of
        units in the whole global mini-batch (all ranks), so the update does not depend on how
        the batch was split across ranks and micro-batches.

        Returns:
            ``loss`` (per unit) and the loss function's metrics, each averaged over the
            micro-batches weighted by their units; ``micro_batches`` and ``packed``
            (1.0 when packed); then ``optimizer_step``'s metrics (``grad_norm``, ``lr``, ``skipped``).
        """
        denom = global_units(batch, loss_fn.unit, self.device)
        parts = self.micro_batches(batch, getattr(loss_fn, "rows_per_group", 1))
        records: list[tuple[float, dict[str, Any]]] = []
        for i, (rows, mb) in enumerate(parts):
            last = i == len(parts) - 1
            key = getattr(loss_fn, "gather_key", None)  # passed only when set: an own engine's forward may not take it
            out = self.forward(mb, need_entropy=loss_fn.needs_entropy and rows is not None,
                               **({"gather": mb[key]} if key else {}))
            if rows is None:  # an empty micro-batch keeping the ranks in step: no loss, no metrics
                self.backward(sum(t.sum() for t in vars(out).values() if t is not None) * 0.0, last=last)
                continue
            w = float(loss_units(mb, loss_fn.unit))  # read where the batch lives (the host), not on the device
            loss_sum, metrics = loss_fn(out, mb.to(self.device, non_blocking=True))
            self.backward(loss_sum / denom, last=last)
            records.append((w, {"loss": loss_sum.detach() / max(w, 1.0), **metrics}))
        perf = {"micro_batches": float(len(parts)), "packed": float(self.packed)}
        return {**unit_weighted_means(records), **perf, **self.optimizer_step()}

    @abstractmethod
    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate the gradients of ``loss`` (already divided by the global units).

        ``last``: this is the mini-batch's last micro-batch (where a backend may reduce).
        """

    @abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Sum the gradients over the data-parallel group, clip, step the optimizer and the LR
        schedule, zero the gradients. A step with a non-finite gradient norm changes nothing.

        Returns:
            ``grad_norm`` (before clipping), ``lr`` (used by this step), ``skipped`` (1.0 if
            the step was not applied).
        """

    @classmethod
    def adapter_options(cls, options: BaseModel) -> BaseModel | None:
        """The LoRA adapter this engine trains with ``options`` (``engines.lora.LoraOptions``), or
        ``None`` when every weight trains. Where it is set, the base weights stay as loaded, so
        ``infer_base`` computes the start model (a reference without a second copy)."""
        return None

    @classmethod
    def model_errors(cls, options: BaseModel, where: str, model_dir: str, head: str) -> list[str]:
        """What ``options`` (the section at YAML path ``where``) cannot do with the model at
        ``model_dir`` built with ``head`` (a LoRA target that is not a layer of it). Each line names
        the path and the fix."""
        return []

    def infer_base(self, batch: Batch) -> Batch:
        """``infer`` with the start model's weights: the base of a LoRA engine with its adapters
        off (see ``adapter_options``). Engines that train every weight keep no start model."""
        raise NotImplementedError(f"{type(self).__name__} trains every weight and keeps no base model; "
                                  f"the reference needs a model of its own")

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights, tensor by tensor (gathered if sharded), in HF naming."""

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends the generator: ``named_weights`` (full weights), unless the
        engine trains a LoRA adapter synced as an adapter (then its tensors only, PEFT's names).
        A collective where ``named_weights`` is."""
        return self.named_weights()

    @abstractmethod
    def save_pretrained(self, path: str) -> None:
        """Write the model (and tokenizer) in HF format, loadable by ``from_pretrained``."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and scheduler state, for exact resume.

        Called on every rank. A replicated engine returns the same on each; a sharded one
        returns its share under ``"shard_files"`` (see ``training.merge_rank_states``).
        """

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def save_state(self, path: str) -> None:
        """Write this rank's part of the training state into the directory ``path``, which every
        rank of the handle reaches (a checkpoint; every rank calls it). Nothing passes through
        the driver. Here: rank 0 writes ``state_dict()`` to ``state.pt`` (a replicated engine: every
        rank holds the same); a sharded engine overrides it so that each rank writes its shard."""
        if self.spec.dist.rank == 0:
            os.makedirs(path, exist_ok=True)
            torch.save(self.state_dict(), os.path.join(path, "state.pt"))

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote to ``path`` (every rank calls it)."""
        self.load_state_dict(torch.load(os.path.join(path, "state.pt"), weights_only=False))


class GenerateEngine(Engine):
    """Samples continuations of token-id prompts and accepts new weights.

    Attributes:
        model_in_process: the weights live in the process that hosts the engine, so a received
            bucket's tensors are handed to the loader as they are (no shared-memory hop: vLLM
            with its engine core in this process). May be decided per instance once built.
        frees_memory_when_asleep: ``sleep`` gives accelerator memory back, so the worker
            returns its own cached memory before ``wake_up`` takes it again.
        pauses_mid_generation: ``receive_weights`` ... ``end_sync`` may run (in another
            thread) while ``generate`` runs: the engine pauses its requests at a token boundary
            at the first bucket, loads, stamps the tokens sampled after ``end_sync`` with the
            new ``version``, and resumes (``SamplingParams.on_update`` says how). Without it
            the caller must not sync during a ``generate`` call.
        batches_concurrent_calls: keyed ``generate`` calls made at once from several threads are
            served together (vLLM's request loop: continuous batching), so a caller may send one
            small call per request (an episode's turn) instead of gathering them first.
        logprobs_are_free: the sampled tokens' logprobs cost nothing to return (the Transformers
            engine has the distribution at hand), so a rollout asks for them for its metrics even
            where no loss term needs them (vLLM: ~30% of its throughput, asked only when needed).
        version: the policy version of the loaded weights (0: the initial ones), set by
            ``end_sync``; ``GenerationOutput.versions`` stamps each token with it.
    """

    Options: ClassVar[type[BaseModel]] = GenerateOptions
    memory_model: ClassVar[str] = "batch"
    model_in_process: bool = True
    frees_memory_when_asleep: bool = False
    pauses_mid_generation: ClassVar[bool] = False
    batches_concurrent_calls: ClassVar[bool] = False
    logprobs_are_free: ClassVar[bool] = False
    version: int = 0

    @classmethod
    def workers_per_engine(cls, options: BaseModel) -> int:
        """Processes one engine receives weights in (tensor-parallel workers); 1 by default."""
        return 1

    @classmethod
    def placement_errors(cls, options: BaseModel, where: str, gpus_per_rank: float, split: bool) -> list[str]:
        """What this engine cannot run on: ``gpus_per_rank`` per generator at YAML path ``where``,
        in the split (``split``) or co-located layout. Each line names the path and the fix."""
        return []

    @classmethod
    def rollout_errors(cls, options: BaseModel, rollout: BaseModel, plan: "RolloutPlan") -> list[str]:
        """What this engine cannot do of the ``rollout`` section (``config.schema.RolloutConfig``)
        with ``plan`` (layout, memory). Each line names the path and the fix."""
        if rollout.in_flight_updates and not cls.pauses_mid_generation:
            return [f"rollout.in_flight_updates: generate engine {cls.__name__} cannot load weights while it "
                    f"generates; set in_flight_updates: false"]
        return []

    @classmethod
    def adapter_errors(cls, options: BaseModel, adapter: BaseModel) -> list[str]:
        """What this engine cannot do with the LoRA ``adapter`` (``engines.lora.LoraOptions``) the
        policy's syncs carry as an adapter (``sync: adapter``). By default it loads full weights only."""
        return [f"policy.train.lora.sync: 'adapter' sends the generator LoRA adapters, and generate engine "
                f"{cls.__name__} loads full weights only; set sync: merged (or use engine: vllm)"]

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> GenerationOutput:
        """Sample one continuation per prompt (truncated after the first stop token, kept).

        ``seeds``: one per prompt. Row ``i`` is then sampled from its own random stream seeded
        with ``seeds[i]``, so its tokens depend only on the seed, the prompt and the weights,
        not on the other rows, the split over ranks, or other threads (asynchronous rollout
        regenerates a batch exactly on resume). ``None``: the engine's own stream.

        May be called from several threads at once (an asynchronous rollout's parts, an eval):
        the engine serialises the calls or batches them together.
        """

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

    def connect_transport(self, transport: "Transport") -> None:
        """Open ``transport``'s receive side where ``receive_weights`` will run it (``Transport.connect``)."""
        transport.connect(self.spec.device)

    def end_sync(self, version: int | None = None) -> None:
        """Called once the last bucket of a sync is loaded: ready the engine to generate.
        ``version``: the policy version just loaded (``None``: unchanged)."""
        if version is not None:
            self.version = version
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


ROLE_BASES: dict[str, type] = {"train": TrainEngine, "infer": InferEngine, "generate": GenerateEngine}


def engine_class(name: str, role: Role) -> type:
    """The engine class for backend ``name`` (or import path ``pkg.mod:Class``) in ``role``.

    Imports the backend's file only (light: heavy libraries load when an engine is built).

    Raises:
        KeyError: an unknown backend (listing the valid ones), or a class of the wrong role.
    """
    key = name if ":" in name else f"{name}.{role}"
    if ":" not in name and key not in ENGINES:
        raise KeyError(f"no {role} engine {name!r}; valid: {', '.join(engine_names(role))} "
                       f"(or an import path 'pkg.module:Class')")
    cls = ENGINES.get(key)
    base = ROLE_BASES[role]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise KeyError(f"{name!r} is not a {base.__name__} subclass")
    return cls


def engine_options(name: str, role: Role, fields: dict[str, Any], path: str = "") -> BaseModel:
    """``fields`` (a YAML section, ``Section.engine_fields()``) validated by the options of engine
    ``name`` in ``role``; ``path`` (e.g. ``policy.train``) names the section in cross-field errors.

    Raises:
        KeyError: see ``engine_class``. pydantic.ValidationError: the options are invalid.
    """
    return engine_class(name, role).Options.model_validate(fields, context={"path": path})


def build_engine(name: str, spec: EngineSpec, role: Role):
    """Instantiate the engine ``name`` for ``role`` (see ``engine_class``).

    Raises:
        KeyError: as ``engine_class``, or when a package the engine needs is not installed
            (naming the pip extra that installs it).
    """
    cls = engine_class(name, role)
    missing = cls.missing_packages()
    if missing:
        extra = f"pip install -e '.[{cls.pip_extra}]'" if cls.pip_extra else "pip install " + " ".join(missing)
        raise KeyError(f"engine {name!r} needs {', '.join(missing)}, which is not installed; install it with: {extra}")
    return cls(spec)


def engine_names(role: Role) -> list[str]:
    """Backend names that ``build_engine`` accepts for ``role`` (every backend file is read)."""
    return sorted(n.rpartition(".")[0] for n in ENGINES.names() if n.endswith("." + role))
