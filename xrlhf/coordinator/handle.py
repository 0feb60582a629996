"""``ModelHandle``: one model (policy, critic, reference, reward) as a group of Ray actors.

Each method declares once how its inputs are split across ranks and how results come back
(the ``dispatch`` decorator), in the manner of verl's ``@register(dispatch_mode=...)``:

* ``DP``: the first argument (a ``Batch`` or a list) is split into consecutive parts, one
  per rank, padded to equal length; results are concatenated in rank order, padding dropped
  (``xrlhf.data.dispatch``, shared with the in-process ``LocalHandle``).
* ``DP_TRAIN``: ``DP`` for a train step: padding rows weigh nothing; the ranks' metrics are
  averaged weighted by their loss units (tokens or rows).
* ``ALL``: every rank gets the same arguments; a list of per-rank results comes back.
* ``RANK0``: only rank 0 runs it.

Calls return results, or with ``wait=False`` a ``Pending`` whose ``get()`` gathers later, so
independent handles can overlap (reference and critic inference, say). A dead worker
surfaces as ``WorkerDiedError`` naming the handle and the rank.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from xrlhf.data.dispatch import ALL, DP, DP_TRAIN, ONE, RANK0, plan
from xrlhf.engines.training import merge_rank_states
from xrlhf.utils import faults
from xrlhf.utils.errors import WorkerDiedError, first_line

__all__ = ["ALL", "DP", "DP_TRAIN", "ONE", "RANK0", "BaseReference", "ModelHandle", "Pending", "ROLLOUT_GROUPS",
           "dispatch"]

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
    healer restart the handle (with the ranks' RNG states as they were after the handle's last
    call that drew from them) and sends the call again. ``draws_rng``: this call draws from the
    workers' RNGs (unkeyed sampling): once it is done, the handle keeps their new states.
    """

    handle: "ModelHandle"
    refs: list[ray.ObjectRef]
    ranks: list[int]
    gather: Callable[[list[Any]], Any]
    issue: Callable[[], list[ray.ObjectRef]] | None = None
    draws_rng: bool = False

    def get(self, timeout: float | None = None) -> Any:
        h = self.handle
        while True:
            try:
                out = self.gather(h._get(self.refs, self.ranks, timeout))
                if self.draws_rng:  # (a rank dead before this answers: the call is redone from the last states)
                    h.saved_rng = h._get([w.rng_state.remote() for w in h.workers], list(range(h.world_size)))
                return out
            except WorkerDiedError as e:
                healer = h.healer
                if healer is None or not healer.heal(e):
                    raise
                if e.handle != h.name:
                    continue  # another handle was restarted; this call's workers are alive
                if self.issue is None:
                    raise
                self.refs = self.issue()


def dispatch(mode: str, gather: Callable[[list[Any]], Any] | None = None, split_kwargs: tuple[str, ...] = (),
             group: str | None = None, target: str | None = None):
    """Declare how a handle method's call is spread over ranks; the body is not run.

    ``gather`` replaces the mode's way of combining the ranks' results; ``split_kwargs`` are
    per-row keyword arguments split like the first (``plan``); ``group``: the actor's
    concurrency group the call runs in (``rollout``: generation, beside the default group's
    training, on workers that have the group); ``target``: the worker method called (default:
    the handle method's name).
    """

    combine = gather

    def deco(fn):
        method = target or fn.__name__
        names = list(inspect.signature(fn).parameters)[1:]  # after self

        @functools.wraps(fn)
        def wrapper(self: "ModelHandle", *args, wait: bool = True, **kwargs):
            if split_kwargs and len(args) > 1:  # per-row arguments given by position: split them by name
                kwargs.update({n: a for n, a in zip(names[1:], args[1:]) if n in split_kwargs})
                args = args[:1] + tuple(a for n, a in zip(names[1:], args[1:]) if n not in split_kwargs)
            ranks, calls, gather = plan(mode, self.world_size, args, kwargs, split_kwargs)

            def issue() -> list[ray.ObjectRef]:  # again after a restart in place: to the new workers
                fns = [getattr(self.workers[r], method) for r in ranks]
                if group is not None and self.concurrent:
                    fns = [f.options(concurrency_group=group) for f in fns]
                return [f.remote(*a, **kw) for f, (a, kw) in zip(fns, calls)]

            # unkeyed sampling draws from the workers' RNGs: a restarted handle must get them as they were
            draws = (method == "generate" and kwargs.get("seeds") is None and self.healer is not None
                     and self.healer.in_place(self.name))
            pending = Pending(self, issue(), ranks, combine or gather, issue, draws)
            return pending.get() if wait else pending

        wrapper.dispatch_mode = mode
        return wrapper

    return deco


class ModelHandle:
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
        self.saved_rng: list[dict] | None = None
        """The ranks' RNG states after the last call that drew from them (handles restarted in
        place: their new workers get these; ``Coordinator.keep_rng``)."""
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

    # -- methods, each with its dispatch ------------------------------------------------------
    @dispatch(DP, split_kwargs=("seeds",), group="rollout")
    def generate(self, prompts, params, seeds=None):
        """Sample continuations; prompts (and their ``seeds``) split across ranks -> ``GenerationOutput``."""

    @dispatch(ONE, group="rollout", target="generate")
    def generate_on(self, rank, prompts, params, seeds=None):
        """``generate`` on rank ``rank`` only (an episode's turns: continuous batching keeps each
        episode on one generator) -> ``GenerationOutput``."""

    @dispatch(DP)
    def infer(self, batch):
        """Logprobs / values / scores of ``batch`` -> ``Batch``."""

    @dispatch(DP)
    def infer_base(self, batch):
        """Logprobs of ``batch`` under the train engines' start model (LoRA adapters off) -> ``Batch``."""

    @dispatch(DP_TRAIN)
    def train_step(self, batch, loss_fn):
        """One optimizer step on a global mini-batch, data-parallel -> metrics, unit-weighted mean
        over ranks."""

    @dispatch(ALL)
    def sync_weights_local(self, version=None):
        """Each rank: its train engine -> its generate engine (``version``: the policy version sent)."""

    @dispatch(RANK0)
    def send_weights(self):
        """Rank 0's weights as a message transport's messages (use ``wait=False``: keep them in Ray)."""

    @dispatch(RANK0)
    def broadcast_weights(self):
        """Rank 0 broadcasts its weights (the receivers must be in ``receive_weights``)."""

    def join_weight_gather(self) -> Pending | None:
        """Ranks 1.. take part in rank 0's gathering of sharded (ZeRO-3) weights during
        ``send_weights`` / ``broadcast_weights``; ``get()`` the result after those. ``None``
        for one rank."""
        ranks = list(range(1, self.world_size))
        if not ranks:
            return None
        return Pending(self, [self.workers[r].join_weight_gather.remote() for r in ranks], ranks, list)

    @dispatch(ALL)
    def receive_weights(self, messages, version=None):
        """Every rank loads the messages (``None``: a broadcast's) -> tensors loaded per rank."""

    @dispatch(ALL)
    def weight_checksums(self, role):
        """Per rank: checksums of the ``"train"`` or ``"generate"`` engine's weights by HF name."""

    @dispatch(ALL)
    def memory_stats(self, reset=True):
        """Per rank: peak/reserved GPU memory of the worker's process and the device's use (GiB)."""

    @dispatch(ALL)
    def save_pretrained(self, path):
        """Every rank takes part (a ZeRO-3 engine gathers its shards); rank 0 writes HF format."""

    @dispatch(ALL, gather=merge_rank_states)
    def state_dict(self):
        """Model, optimizer and scheduler state: rank 0's where all ranks hold the same after a
        step, the union of the ranks' shards for a sharded engine (``merge_rank_states``)."""

    @dispatch(ALL)
    def save_state(self, path):
        """Every rank writes its part of the training state into the directory ``path`` (a
        sharded engine: each rank its own shard files; nothing passes through the driver)."""

    @dispatch(ALL)
    def load_state(self, path):
        """Every rank restores its part from ``path``."""

    @dispatch(ALL)
    def load_state_dict(self, state):
        """Every rank restores the same state."""

    @dispatch(ALL)
    def rng_state(self):
        """Every rank's RNG state."""

    @dispatch(ALL)
    def pid(self):
        """Every rank's process id."""

    @dispatch(ALL)
    def sleep_generator(self):
        """Release the generate engines' memory."""

    @dispatch(ALL)
    def wake_generator(self):
        """Bring the generate engines back."""

    def set_rng_state(self, states: list[dict]) -> None:
        """Every rank's RNG state, as ``rng_state`` returned it."""
        self._get([w.set_rng_state.remote(s) for w, s in zip(self.workers, states)], list(range(self.world_size)))

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

    @dispatch(DP, target="infer_base")
    def infer(self, batch):
        """Logprobs of ``batch`` under the policy's base -> ``Batch``."""
