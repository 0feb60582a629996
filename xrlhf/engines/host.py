"""``EngineHost``: the engines of one rank of a model handle, as plain methods, without Ray.

A host holds the engines of its handle for one rank (the policy: a train and a generate
engine; the critic: a train engine; the reference and reward: an infer engine) and exposes
them as plain methods. It knows nothing about algorithms: losses arrive as picklable
callables built by the algorithm layer.

Why apart from the Ray actor: the same code serves two ways of running a rank. The
coordinator's ``EngineWorker`` (``coordinator/worker.py``) is this class plus what only a Ray
actor needs (its node's address); ``algorithms/local.py``'s ``LocalHandle`` hosts it in the
driver process (tests, the supervised warm-up). One execution path, two places to run it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import torch

from xrlhf.data.batch import Batch
from xrlhf.engines.base import (DistInfo, EngineSpec, GenerateEngine, GenerationOutput, InferEngine, LossFn,
                                SamplingParams, TrainEngine, build_engine, engine_class)
from xrlhf.utils.errors import UserError
from xrlhf.weight_sync import Message, build_transport, checksums_by_name, push_weights

SETUP_ENV = "XRLHF_WORKER_SETUP"
"""``module:function``: with it set, every ``EngineHost`` (each worker's, and the in-process
runner's) calls ``function(host)`` once made, before it builds an engine. A place for a
process-wide diagnostic, without a change to xrlhf: a profiler set as ``host.around``, a log of
the garbage collector (``benchmarks.common.worker_diagnostics``)."""


def _direct(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def setup_hook() -> Callable[["EngineHost"], Any] | None:
    """The function ``SETUP_ENV`` names (None where it is unset); a name that does not resolve is a
    ``UserError`` of one line naming the variable and the fix (``xrlhf run`` checks it before anything
    starts)."""
    target = os.environ.get(SETUP_ENV)
    if not target:
        return None
    import importlib

    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"{SETUP_ENV}={target}: cannot load it ({e}); name an importable module:function "
                        f"or unset it") from None


class EngineHost:
    """One rank of a handle: its engines by role, and the calls a handle makes on them.

    Args:
        handle: the handle's name (for messages).
        rank: this worker's rank in the handle.
        threads: torch CPU threads for this worker.
    """

    def __init__(self, handle: str, rank: int, threads: int = 1):
        self.handle = handle
        self.rank = rank
        torch.set_num_threads(max(1, threads))
        self.train: TrainEngine | None = None
        self.infer_engine: InferEngine | None = None
        self.gen: GenerateEngine | None = None
        self.transport = None
        self._outbox = None  # the buckets of a sync under way (``begin_send``)
        self._preload_s: float | None = None  # how long ``preload``'s imports took, once done
        self._preloading: threading.Thread | None = None
        self._preload_at: float | None = None  # when ``preload`` was called (the start-up timeline)
        # How each engine's build and ``preload`` is called: ``around(what, fn, *args)``, ``what`` naming
        # it (``<handle>-<rank>-<role>`` and ``...-preload``). A ``SETUP_ENV`` function may wrap it.
        self.around: Callable[..., Any] = _direct
        if (hook := setup_hook()) is not None:
            hook(self)

    # -- set-up ---------------------------------------------------------------------------
    def setup(self, engines: dict[str, tuple[str, EngineSpec]], dist: DistInfo) -> dict[str, Any]:
        """Build the engines: ``engines`` maps a role (train / infer / generate) to (name, spec).
        Returns this process's id, the device, ``seconds``: each role's build and, once done, the
        ``preload`` imports, and ``done_at`` (the clock's time at the end), for the coordinator's
        start-up timeline."""
        seconds: dict[str, float] = {}
        if self._preloading is not None:
            # The build waits for preload's imports rather than importing the same package beside
            # them from a second thread. That did not speed the import (docs/benchmarks.md), but the import
            # then has one owner, and the time it reports is the import's alone.
            self._preloading.join()
        for role, (name, spec) in engines.items():
            spec.dist = dist
            if spec.device == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(f"{self.handle} rank {self.rank}: a GPU was asked for but CUDA is not available")
            t0 = time.perf_counter()
            engine = self.around(f"{self.handle}-{self.rank}-{role}", build_engine, name, spec, role)
            seconds[f"{role}_s"] = round(time.perf_counter() - t0, 2)
            setattr(self, {"train": "train", "infer": "infer_engine", "generate": "gen"}[role], engine)
        if self._preload_s:  # engines that import nothing at preload take ~0 s: not worth a word
            seconds["imports_s"] = self._preload_s
        return {"pid": os.getpid(), "device": str(next(iter(engines.values()))[1].device), "seconds": seconds,
                "done_at": time.time()}

    def preload(self, engines: dict[str, tuple[str, EngineSpec]]) -> None:
        """Start importing what ``engines`` will need (``Engine.preload``: vLLM's import, seconds long) in a
        thread, so that it overlaps whatever this worker waits for before ``setup`` builds them;
        a failure here is left for ``setup`` to report."""
        self._preload_at = time.time()

        def run() -> None:
            t0 = time.perf_counter()
            for role, (name, spec) in engines.items():
                try:
                    self.around(f"{self.handle}-{self.rank}-{role}-preload", engine_class(name, role).preload,
                                spec.options)
                except Exception:  # noqa: BLE001 - the build raises it with its context
                    pass
            self._preload_s = round(time.perf_counter() - t0, 2)

        self._preloading = threading.Thread(target=run, name="xrlhf-preload", daemon=True)
        self._preloading.start()

    def set_transport(self, options: dict[str, Any], name: str) -> str:
        """Build this worker's side of the weight-sync transport ``name`` (chosen by the
        coordinator: ``weight_sync.choose_transport``) with ``options``; returns the name."""
        opts = dict(options)
        if isinstance(opts.get("dtype"), str):
            opts["dtype"] = getattr(torch, opts["dtype"])
        if self.transport is not None:
            self.transport.close()  # re-wired: the old side's shared memory goes now, not at exit
        self.transport = build_transport(name, **opts)
        return name

    def connect_transport(self) -> None:
        """Open this worker's side of the transport now (``Transport.connect``): a generator's
        where it receives, a trainer's on its device."""
        if self.gen is not None:
            self.gen.connect_transport(self.transport)
        else:
            self.transport.connect(self.train.device)

    def pid(self) -> int:
        return os.getpid()

    # -- compute --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> GenerationOutput:
        return self.gen.generate(prompts, params, seeds)

    def infer(self, batch: Batch) -> Batch:
        engine = self.infer_engine or self.train
        return engine.infer(batch)

    def infer_base(self, batch: Batch) -> Batch:
        """The train engine's start model (LoRA adapters off): a reference without a model of its own."""
        return self.train.infer_base(batch)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        return self.train.train_step(batch, loss_fn)

    # -- weights --------------------------------------------------------------------------
    def sync_weights_local(self, version: int | None = None) -> int:
        """Train engine -> generate engine of this worker, through the configured transport;
        ``version``: the policy version sent (stamped on the tokens sampled with it)."""
        if self.gen.frees_memory_when_asleep:
            self.release_memory()  # the train step's cached blocks, before anything wakes
        n = push_weights(self.transport, self.train.weights_for_sync(), self.gen.receive_weights)
        self._end_sync(version)
        return n

    def send_weights(self) -> list[Message]:
        """Sender side of a message transport to other workers: every bucket's message at once
        (transports whose buckets stay valid after the next is packed: ``cpu``, ``disk``)."""
        return list(self.transport.send(self.train.weights_for_sync()))

    def begin_send(self) -> None:
        """Start a sync bucket by bucket (``next_message``): a bucket stays valid until the next
        is asked for, as ``Transport.send`` promises (``cuda_ipc``'s handles point into it)."""
        self._outbox = iter(self.transport.send(self.train.weights_for_sync()))

    def next_message(self) -> Message | None:
        """The next bucket's message; ``None`` once all are sent (the transport then cleans up)."""
        message = next(self._outbox, None)
        if message is None:
            self._outbox = None
        return message

    def broadcast_weights(self) -> int:
        """Sender side of a broadcast transport (the receivers run ``receive_weights`` meanwhile)."""
        return sum(len(m.names) for m in self.transport.send(self.train.weights_for_sync()))

    def receive_weights(self, messages: list[Message] | None = None) -> int:
        """Receiver side: load a message transport's buckets, or a broadcast's (``None``); the
        sync ends with ``end_sync``."""
        return self.gen.receive_weights(self.transport, messages)

    def receive_message(self, message: Message | None) -> int:
        """One bucket of a sync sent bucket by bucket (``None``: the sender has sent all)."""
        return 0 if message is None else self.gen.receive_weights(self.transport, [message])

    def end_sync(self, version: int | None = None) -> None:
        """The sync is over: the generator holds policy ``version`` (and wakes what slept)."""
        self._end_sync(version)

    def release_memory(self) -> None:
        """Return this process's cached accelerator memory (a trainer, before its co-located
        generator's KV cache wakes in another process)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _end_sync(self, version: int | None = None) -> None:
        if self.gen.frees_memory_when_asleep:
            self.release_memory()  # this process's cached blocks go back before vLLM's KV cache does
        self.gen.end_sync(version)

    def join_weight_gather(self) -> int:
        """A rank > 0 of a sharded trainer (ZeRO-3) takes part in gathering the full weights
        while rank 0 sends them; nothing to do where ``named_weights`` is not a collective."""
        if not self.train.collective_weights:
            return 0
        return sum(1 for _ in self.train.weights_for_sync())

    def weight_checksums(self, role: str) -> dict[str, int]:
        """Checksums by name of what a sync sends (``"train"``, in the generator's dtype: full weights by HF
        name, or a LoRA adapter's tensors) or of what the generator holds (``"generate"``)."""
        if role == "generate":
            return self.gen.weight_checksums()
        dtype = getattr(self.transport, "dtype", None)
        return checksums_by_name((n, t if dtype is None else t.to(dtype)) for n, t in self.train.weights_for_sync())

    def memory_stats(self, reset: bool = True) -> dict[str, float]:
        """This process's memory (GiB): its resident set ``rss_gb`` now; on a GPU also its peak
        allocated (since the last reset) and reserved memory, the device's use by every process
        (``device_used_gb``) and ``alloc_retries``: how often torch's allocator found the device
        full since the last reset, freed its whole cache and tried again (each time a device-wide
        wait, and every freed block allocated anew later). ``reset``: start a new peak and count."""
        stats = {"rss_gb": _rss_bytes() / 2**30, "pid": os.getpid()}
        if not torch.cuda.is_available():
            return stats
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        stats.update({"gpu": str(props.uuid), "gpu_name": props.name})  # which GPU: throughput per GPU, MFU
        stats.update({"max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
                      "reserved_gb": torch.cuda.memory_reserved() / 2**30, "device_used_gb": (total - free) / 2**30,
                      "alloc_retries": int(torch.cuda.memory_stats().get("num_alloc_retries", 0))})
        if reset:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.reset_accumulated_memory_stats()
        return stats

    def save_pretrained(self, path: str) -> str:
        self.train.save_pretrained(path)
        return path

    def state_dict(self) -> dict[str, Any]:
        return self.train.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train.load_state_dict(state)

    def save_state(self, path: str) -> None:
        self.train.save_state(path)

    def load_state(self, path: str) -> None:
        self.train.load_state(path)

    def rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "gen": self.gen.rng_state() if self.gen is not None else {}}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if self.gen is not None:
            self.gen.set_rng_state(state["gen"])

    # -- memory phases (co-located layouts) -------------------------------------------------
    def shutdown(self) -> None:
        """Free what the engines and the transport hold outside Python's reach (a vLLM engine's
        processes and memory, shared-memory buffers)."""
        if self.transport is not None:
            self.transport.close()
        if self.gen is not None:
            self.gen.shutdown()

    def sleep_generator(self) -> None:
        if self.gen is not None:
            self.gen.sleep()

    def wake_generator(self) -> None:
        if self.gen is not None:
            self.gen.wake_up()


def _rss_bytes() -> int:
    """This process's resident set size (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
