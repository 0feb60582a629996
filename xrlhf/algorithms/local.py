"""``LocalHandle`` / ``LocalHandles``: models hosted in this process, behind the trainers' seam.

Why: tests, notebooks and the supervised warm-up want a trainer on a model without starting
Ray. Rather than a second execution path, a local handle calls the very ``EngineHost`` that a
Ray ``EngineWorker`` is (``xrlhf.engines.host``), and spreads calls with the very dispatch
plan of ``ModelHandle`` (``xrlhf.data.dispatch.plan``: split, pad, gather, unit-weighted
metrics). It satisfies ``algorithms.handles.Handle`` / ``Handles``.

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
from xrlhf.data.dispatch import ALL, DP, DP_TRAIN, ONE, RANK0, plan
from xrlhf.engines.base import (DistInfo, EngineSpec, GenerateEngine, GenerationOutput, InferEngine, LossFn,
                                SamplingParams, TrainEngine)
from xrlhf.engines.host import EngineHost
from xrlhf.engines.training import merge_rank_states


@dataclass
class Done:
    """A local call's result, already computed; ``get()`` returns it (the ``Pending`` shape)."""

    value: Any

    def get(self, timeout: float | None = None) -> Any:
        return self.value


class LocalHandle:
    """A model handle whose ranks are ``EngineHost`` objects in this process.

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

    def _call(self, mode: str, method: str, *args, wait: bool = True,
              combine: Callable[[list[Any]], Any] | None = None, split_kwargs: tuple[str, ...] = (), **kwargs) -> Any:
        ranks, calls, gather = plan(mode, self.world_size, args, kwargs, split_kwargs)
        results = [getattr(self.hosts[r], method)(*a, **kw) for r, (a, kw) in zip(ranks, calls)]
        out = (combine or gather)(results)
        return out if wait else Done(out)

    # -- the calls trainers make (``Handle``) -------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None, *,
                 wait: bool = True) -> GenerationOutput | Done:
        return self._call(DP, "generate", prompts, params, seeds=seeds, split_kwargs=("seeds",), wait=wait)

    def generate_on(self, rank: int, prompts: list[list[int]], params: SamplingParams,
                    seeds: list[int] | None = None, *, wait: bool = True) -> GenerationOutput | Done:
        """``generate`` on rank ``rank`` only (``Handle.generate_on``)."""
        return self._call(ONE, "generate", rank, prompts, params, seeds=seeds, wait=wait)

    def infer(self, batch: Batch, *, wait: bool = True) -> Batch | Done:
        return self._call(DP, "infer", batch, wait=wait)

    def infer_base(self, batch: Batch, *, wait: bool = True) -> Batch | Done:
        """``infer`` with the train engines' start model (LoRA adapters off)."""
        return self._call(DP, "infer_base", batch, wait=wait)

    def base_reference(self) -> "LocalHandle":
        """A reference handle that is this handle's base (``coordinator.handle.BaseReference``'s
        in-process twin): same hosts, ``infer`` with the LoRA adapters off, nothing to save."""
        ref = _BaseReference("reference", self.hosts)
        ref.trainable = False
        return ref

    def train_step(self, batch: Batch, loss_fn: LossFn, *, wait: bool = True) -> dict[str, float] | Done:
        if self.world_size > 1:
            raise NotImplementedError(f"{self.name}: in-process ranks cannot sum their gradients; "
                                      f"a local handle trains on one rank (use the Ray coordinator for more)")
        return self._call(DP_TRAIN, "train_step", batch, loss_fn, wait=wait)

    def save_pretrained(self, path: str, *, wait: bool = True) -> Any:
        return self._call(ALL, "save_pretrained", path, wait=wait)

    def state_dict(self, *, wait: bool = True) -> Any:
        return self._call(ALL, "state_dict", wait=wait, combine=merge_rank_states)

    def load_state_dict(self, state: dict[str, Any], *, wait: bool = True) -> Any:
        return self._call(ALL, "load_state_dict", state, wait=wait)

    def save_state(self, path: str, *, wait: bool = True) -> Any:
        return self._call(ALL, "save_state", path, wait=wait)

    def load_state(self, path: str, *, wait: bool = True) -> Any:
        return self._call(ALL, "load_state", path, wait=wait)

    def rng_state(self, *, wait: bool = True) -> Any:
        return self._call(ALL, "rng_state", wait=wait)

    def set_rng_state(self, states: list[dict[str, Any]]) -> None:
        for host, state in zip(self.hosts, states):
            host.set_rng_state(state)

    # -- weights between the policy's own engines ---------------------------------------------
    def sync_weights_local(self, version: int | None = None, *, wait: bool = True) -> Any:
        """Each rank: its train engine -> its generate engine (``in_process`` transport)."""
        for host in self.hosts:
            if host.transport is None:
                host.set_transport("in_process", {})
        return self._call(ALL, "sync_weights_local", version, wait=wait)

    def shutdown(self) -> None:
        """Free every rank's engines now (a vLLM generator's processes and GPU memory)."""
        for host in self.hosts:
            host.shutdown()

    def sleep_generator(self, *, wait: bool = True) -> Any:
        return self._call(ALL, "sleep_generator", wait=wait)

    def weight_checksums(self, role: str, *, wait: bool = True) -> Any:
        return self._call(RANK0, "weight_checksums", role, wait=wait)


class _BaseReference(LocalHandle):
    """See ``LocalHandle.base_reference``."""

    def infer(self, batch: Batch, *, wait: bool = True) -> Batch | Done:
        return self.infer_base(batch, wait=wait)


class LocalHandles:
    """The models of a run in this process; satisfies ``algorithms.handles.Handles``.

    Args:
        policy: the trained model; with a generate engine it is also the generator.
        critic, reference, reward: ``None`` when absent.
        rollout: a separate generator handle (its weights are then not synced by
            ``sync_weights``: tests that use one load it themselves).
    """

    def __init__(self, policy: LocalHandle, critic: LocalHandle | None = None,
                 reference: LocalHandle | None = None, reward: LocalHandle | None = None,
                 rollout: LocalHandle | None = None):
        self.handles = {n: h for n, h in (("policy", policy), ("critic", critic), ("reference", reference),
                                          ("reward", reward), ("rollout", rollout)) if h is not None}

    @property
    def policy(self) -> LocalHandle:
        return self.handles["policy"]

    @property
    def generator(self) -> LocalHandle:
        return self.handles.get("rollout") or self.handles["policy"]

    @property
    def critic(self) -> LocalHandle | None:
        return self.handles.get("critic")

    @property
    def reference(self) -> LocalHandle | None:
        return self.handles.get("reference")

    @property
    def reward(self) -> LocalHandle | None:
        return self.handles.get("reward")

    def sync_weights(self, version: int | None = None) -> float:
        """The policy's train engines -> its own generate engines (when it has them)."""
        t0 = time.time()
        if self.policy.hosts[0].gen is not None and self.policy.hosts[0].train is not None:
            self.policy.sync_weights_local(version)
        return time.time() - t0

    def memory(self) -> dict[str, list[dict[str, float]]]:
        """Every handle's hosts' memory (one process: the same figures for each)."""
        return {name: [host.memory_stats() for host in h.hosts] for name, h in self.handles.items()}

    def end_rollout(self) -> None:
        """The policy's generate engines may free their memory until the next sync."""
        if self.policy.hosts[0].gen is not None:
            self.policy.sleep_generator()
