"""``LocalHandle`` / ``LocalHandles``: models hosted in this process, behind the trainers' seam.

Why: tests, notebooks and the supervised warm-up want a trainer on a model without starting
Ray. Rather than a second execution path, a local handle calls the very ``EngineHost`` that a
Ray ``EngineWorker`` is (``xrlhf.engines.host``), through the very call declarations of
``ModelHandle`` (``xrlhf.engines.handles.HandleCalls``: split, pad, gather, unit-weighted
metrics); ``LocalHandles`` implements ``engines.handles.Handles`` as the Ray ``Coordinator`` does.

Ranks run one after another in this process. With several hosts, ``generate`` / ``infer``
split and pad exactly as a Ray handle does; a ``train_step`` needs the ranks' gradients summed
(a torch.distributed group, which ranks in one process cannot form), so a local handle trains
on one rank only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from xrlhf.data.batch import Batch
from xrlhf.data.dispatch import DP_TRAIN, plan
from xrlhf.engines.base import DistInfo, EngineSpec, GenerateEngine, InferEngine, TrainEngine
from xrlhf.engines.handles import HandleCalls, Handles
from xrlhf.engines.host import EngineHost


@dataclass
class Done:
    """A local call's result, already computed; ``get()`` returns it (the ``Pending`` shape)."""

    value: Any

    def get(self, timeout: float | None = None) -> Any:
        return self.value


class LocalHandle(HandleCalls):
    """A model handle whose ranks are ``EngineHost`` objects in this process; it runs the calls
    declared in ``engines.calls.HandleCalls`` with their dispatch, like the Ray ``ModelHandle``.

    Args:
        name: ``policy``, ``critic``, ``reference``, ``reward`` or ``rollout``.
        hosts: one host per rank, in rank order (usually one).
    """

    def __init__(self, name: str, hosts: list[EngineHost]):
        self.name = name
        self.hosts = list(hosts)
        self.trainable = self.hosts[0].train is not None

    @classmethod
    def of(cls, name: str, train: TrainEngine | None = None, infer: InferEngine | None = None,
           generate: GenerateEngine | None = None) -> "LocalHandle":
        """A one-rank handle on engines built by the caller."""
        host = EngineHost(name, 0, threads=torch.get_num_threads())  # keep this process's thread count
        host.train, host.infer_engine, host.gen = train, infer, generate
        return cls(name, [host])

    @classmethod
    def build(cls, name: str, engines: dict[str, tuple[str, EngineSpec]]) -> "LocalHandle":
        """A one-rank handle whose host builds ``engines`` (role -> (engine name, spec)) as a
        Ray worker's ``setup`` would."""
        host = EngineHost(name, 0, threads=torch.get_num_threads())
        host.setup(engines, DistInfo())
        return cls(name, [host])

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def _dispatch(self, mode: str, method: str, args: tuple, kwargs: dict, *, wait: bool,
                  gather: Callable | None, split_kwargs: tuple[str, ...], group: str | None, redo: bool = True) -> Any:
        """The ranks one after another in this process (``HandleCalls``)."""
        if mode == DP_TRAIN and self.world_size > 1:
            raise NotImplementedError(f"{self.name}: in-process ranks cannot sum their gradients; "
                                      f"a local handle trains on one rank (use the Ray coordinator for more)")
        ranks, calls, combine = plan(mode, self.world_size, args, kwargs, split_kwargs)
        results = [getattr(self.hosts[r], method)(*a, **kw) for r, (a, kw) in zip(ranks, calls)]
        out = (gather or combine)(results)
        return out if wait else Done(out)

    def base_reference(self) -> "LocalHandle":
        """A reference handle that is this handle's base (``coordinator.handle.BaseReference``'s
        in-process twin): same hosts, ``infer`` with the LoRA adapters off, nothing to save."""
        ref = _BaseReference("reference", self.hosts)
        ref.trainable = False
        return ref

    def sync_weights_local(self, version: int | None = None, *, wait: bool = True) -> Any:
        """Each rank: its train engine -> its generate engine (``in_process`` transport)."""
        for host in self.hosts:
            if host.transport is None:
                host.set_transport({}, "in_process")
        return super().sync_weights_local(version, wait=wait)

    def shutdown(self) -> None:
        """Free every rank's engines now (a vLLM generator's processes and GPU memory)."""
        for host in self.hosts:
            host.shutdown()


class _BaseReference(LocalHandle):
    """See ``LocalHandle.base_reference``."""

    def infer(self, batch: Batch, *, wait: bool = True) -> Batch | Done:
        return self.infer_base(batch, wait=wait)


class LocalHandles(Handles):
    """The models of a run in this process (``engines.handles.Handles``).

    Args:
        policy: the trained model; with a generate engine and no ``rollout``, also the generator.
        critic, reference, reward, teacher: ``None`` when absent.
        rollout: a separate generator handle (its weights are then not synced by
            ``sync_weights``: tests that use one load it themselves).
        reference_from_policy: the reference is the policy's base (LoRA adapters off).
    """

    def __init__(self, policy: LocalHandle, critic: LocalHandle | None = None,
                 reference: LocalHandle | None = None, reward: LocalHandle | None = None,
                 rollout: LocalHandle | None = None, teacher: LocalHandle | None = None,
                 reference_from_policy: bool = False):
        if rollout is None and policy.hosts[0].gen is not None:
            rollout = policy  # the policy samples with its own generate engine
        self.handles = {n: h for n, h in (("policy", policy), ("critic", critic), ("reference", reference),
                                          ("reward", reward), ("rollout", rollout), ("teacher", teacher))
                        if h is not None}
        self.reference_from_policy = reference_from_policy

    def sync_weights(self, version: int | None = None) -> float:
        """The policy's train engines -> its own generate engines (when it has them)."""
        t0 = time.time()
        if self.policy.hosts[0].gen is not None and self.policy.hosts[0].train is not None:
            self.policy.sync_weights_local(version)
        return time.time() - t0

    def memory(self) -> dict[str, list[dict[str, float]]]:
        """Every handle's hosts' memory (one process: the same figures for each). Each handle is
        asked once: a read resets the peaks, and the policy may be its own ``rollout``."""
        read: dict[int, list[dict[str, float]]] = {}
        for h in self.handles.values():
            read.setdefault(id(h), [host.memory_stats() for host in h.hosts])
        return {name: read[id(h)] for name, h in self.handles.items()}

    def end_rollout(self) -> None:
        """The policy's generate engines may free their memory until the next sync."""
        if self.policy.hosts[0].gen is not None:
            self.policy.sleep_generator()
