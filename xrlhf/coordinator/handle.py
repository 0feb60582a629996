"""``ModelHandle``: one model (policy, critic, reference, reward, rollout) as a group of Ray actors.

The calls and their dispatch are declared once in ``xrlhf.engines.handles.HandleCalls`` (the
in-process ``LocalHandle`` runs the same declarations); this class runs them as Ray calls, one
actor (``EngineWorker``) per rank. Calls return results, or with ``wait=False`` a ``Pending``
whose ``get()`` gathers later, so independent handles overlap (reference and critic inference,
say). A dead worker surfaces as ``WorkerDiedError`` naming the handle and the rank; a handle
restarted in place by its healer sends the interrupted call again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from xrlhf.data.dispatch import plan
from xrlhf.engines.handles import HandleCalls
from xrlhf.utils import faults
from xrlhf.utils.errors import WorkerDiedError, first_line

__all__ = ["BaseReference", "ModelHandle", "Pending", "ROLLOUT_GROUPS"]

_SLICE_S = 1.0

ROLLOUT_GROUPS = {"rollout": 8}
"""Ray concurrency groups of a worker that generates: ``generate`` runs in ``rollout`` (up to
8 calls at once: the parts of a streamed batch, an eval), everything else in the default group
(one at a time), so an asynchronous rollout's generation overlaps a co-located trainer's step
in the same actor. Engines serialise or batch concurrent ``generate`` calls themselves."""


@dataclass
class Pending:
    """Results still being computed by a handle's ranks; ``get()`` waits and gathers.

    ``issue`` sends the call again (the same arguments, to the handle's current workers): when a
    worker of a handle that is restarted in place (``ModelHandle.healer``) dies, ``get`` has the
    healer restart the handle and sends the call again. (Generation is keyed by per-sample
    seeds everywhere, so a call sent again samples what the dead worker would have.)
    """

    handle: "ModelHandle"
    refs: list[ray.ObjectRef]
    ranks: list[int]
    gather: Callable[[list[Any]], Any]
    issue: Callable[[], list[ray.ObjectRef]] | None = None

    def get(self, timeout: float | None = None) -> Any:
        h = self.handle
        while True:
            try:
                return self.gather(h._get(self.refs, self.ranks, timeout))
            except WorkerDiedError as e:
                healer = h.healer
                if healer is None or not healer.heal(e):
                    raise
                if e.handle != h.name:
                    continue  # another handle was restarted; this call's workers are alive
                if self.issue is None:
                    raise
                self.refs = self.issue()


class ModelHandle(HandleCalls):
    """A model as a group of ``EngineWorker`` actors, one per rank.

    Args:
        name: ``policy``, ``critic``, ``reference`` or ``reward``.
        workers: the actor handles, in rank order.
        trainable: whether the ranks hold a train engine (its state goes into checkpoints).
    """

    def __init__(self, name: str, workers: Sequence[Any], trainable: bool = False, concurrent: bool = False):
        self.name = name
        self.workers = list(workers)
        self.trainable = trainable
        self.concurrent = concurrent
        """Whether the workers have the ``rollout`` concurrency group (``ROLLOUT_GROUPS``):
        ``generate`` then runs beside training instead of queueing behind it."""
        self.monitor: Any = None
        """A ``health.Heartbeat`` polled while this handle's calls are waited for (or ``None``)."""
        self.healer: Any = None
        """The coordinator (or ``None``): ``healer.heal(error)`` restarts a dead worker's handle in
        place and returns True, or returns False (the run restarts from a checkpoint);
        ``healer.in_place(name)``: whether handle ``name`` is restarted in place."""

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _get(self, refs: list[ray.ObjectRef], ranks: list[int], timeout: float | None = None) -> list[Any]:
        """Results in rank order. A rank that dies fails the call at once, even while the other
        ranks are blocked in a collective waiting for it (they are killed: the handle is lost)."""
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # in slices: a failure of background work (an asynchronous rollout's dead generator)
            # stops a caller waiting here within a second (``utils.faults``)
            ready, pending = ray.wait(pending, num_returns=1, timeout=_SLICE_S if left is None else min(left, _SLICE_S))
            if not ready:
                faults.check()
                if self.monitor is not None:
                    self.monitor.check()  # a dead or frozen worker (of any handle) ends the wait
                if deadline is None or time.monotonic() < deadline:
                    continue
                rank = ranks[index[pending[0]]]
                raise WorkerDiedError(f"{self.name} rank {rank} did not answer within {timeout} s", self.name, rank,
                                      self.workers[rank])
            ref = ready[0]
            try:
                results[index[ref]] = ray.get(ref)
            except RayActorError as e:
                if isinstance(e, RayTaskError):  # this rank is alive: a worker its call needed died
                    raise self._other_died(ranks[index[ref]], e) from None
                self.kill()
                raise self._died(ranks[index[ref]], e) from None
            except RayTaskError:
                # A rank that fails inside a collective usually does so because a peer died:
                # report the dead peer when there is one; otherwise it is a real error.
                dead = self._first_dead(pending, index, ranks)
                self.kill()
                if dead is not None:
                    raise dead from None
                raise
        return results

    def _other_died(self, rank: int, e: BaseException) -> WorkerDiedError:
        """Rank ``rank``'s call failed because another worker died (an object it read was lost
        with its owner): the dead one, found by the heartbeat, or an error naming no handle
        (the run then restarts from a checkpoint rather than heal the wrong handle)."""
        if self.monitor is not None:
            dead = self.monitor.find_dead()
            if dead is not None:
                return dead
        return WorkerDiedError(f"{self.name} rank {rank}: its call failed because a worker it needed died: "
                               f"{first_line(e)}")

    def _died(self, rank: int, e: BaseException) -> WorkerDiedError:
        worker = self.workers[rank] if rank < len(self.workers) else None
        return WorkerDiedError(f"{self.name} rank {rank} died: {first_line(e)}", self.name, rank, worker)

    def _first_dead(self, pending: list, index: dict, ranks: list[int],
                    wait_s: float = 10.0) -> WorkerDiedError | None:
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as e:
                return self._died(ranks[index[ref]], e)
            except Exception:  # noqa: BLE001 - only a dead peer is of interest here
                continue
        return None

    def base_reference(self) -> "BaseReference":
        """This handle's base as the reference (``BaseReference``)."""
        return BaseReference(self)

    def _dispatch(self, mode: str, method: str, args: tuple, kwargs: dict, *, wait: bool,
                  gather: Callable | None, split_kwargs: tuple[str, ...], group: str | None, redo: bool = True) -> Any:
        """``HandleCalls``' calls as Ray calls on the workers, gathered by a ``Pending``."""
        ranks, calls, combine = plan(mode, self.world_size, args, kwargs, split_kwargs)

        def issue() -> list[ray.ObjectRef]:  # again after a restart in place: to the new workers
            fns = [getattr(self.workers[r], method) for r in ranks]
            if group is not None and self.concurrent:
                fns = [f.options(concurrency_group=group) for f in fns]
            return [f.remote(*a, **kw) for f, (a, kw) in zip(fns, calls)]

        pending = Pending(self, issue(), ranks, gather or combine, issue if redo else None)
        return pending.get() if wait else pending

    def join_weight_gather(self) -> Pending | None:
        """Ranks 1.. take part in rank 0's gathering of sharded (ZeRO-3) weights during
        ``send_weights`` / ``broadcast_weights``; ``get()`` the result after those. ``None``
        for one rank."""
        ranks = list(range(1, self.world_size))
        if not ranks:
            return None
        return Pending(self, [self.workers[r].join_weight_gather.remote() for r in ranks], ranks, list)

    def kill(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)


class BaseReference(ModelHandle):
    """The reference as the policy's own base: the policy's workers, whose train engines compute
    ``infer`` with their LoRA adapters off (``TrainEngine.infer_base``). No worker, no model and
    no state of its own: the coordinator keeps it out of its handles (not checkpointed, not
    killed twice); a trainer calls ``reference.infer`` as on any reference.
    """

    def __init__(self, policy: ModelHandle):
        super().__init__("reference", policy.workers, trainable=False, concurrent=policy.concurrent)
        self.healer, self.monitor = policy.healer, policy.monitor

    def infer(self, batch, *, wait: bool = True):
        """Logprobs of ``batch`` under the policy's base -> ``Batch``."""
        return self.infer_base(batch, wait=wait)
