"""Weight routes across Ray workers: which worker sends, which receive, and in what order.

The transports themselves (how a bucket travels) are ``xrlhf.weight_sync``; the transport of a
run is chosen by the shell (``topology.weight_sync_plan``). This module only decides who sends
to whom. The generators are always a handle of their own, ``rollout``; two layouts:

* **co-located** (``policy.generate.resources`` unset): generator ``r`` shares the bundle (the
  GPU) of policy rank ``r``, and each policy rank sends its own weights to its own generator,
  bucket by bucket (``begin_send`` / ``next_message``: a ``cuda_ipc`` bucket points into the
  trainer's memory and stays valid only until the next is asked for). The messages go from
  worker to worker through Ray's object store, never through the driver. Between the rollout
  and the update the generators may sleep (vLLM frees its KV cache, and its weights at
  ``sleep_level: 2``); a sync wakes the weights, and the KV cache once the trainer has returned
  its cached memory (``release_memory``, then ``end_sync``: the order of verl and OpenRLHF). The
  trainer also returns it before the first bucket: the KV cache then wakes faster
  (docs/vllm.md, "Facts worth keeping (vLLM 0.33)").
* **split** (``policy.generate.resources`` set): the generators run on devices of their own.
  Policy rank 0 sends (every trainer rank holds the same weights after a step). A message
  transport (``cpu``, ``disk``): rank 0's messages go to the object store once and every
  rollout worker reads them from there. A broadcast transport (``nccl``): the receivers are
  started first, then the sender, because each bucket is a collective.
"""

from __future__ import annotations

import time

import ray

from xrlhf.coordinator.handle import ModelHandle
from xrlhf.coordinator.spec import WeightSyncPlan
from xrlhf.engines.base import engine_class
from xrlhf.utils.errors import WorkerDiedError
from xrlhf.weight_sync import WeightSyncError, check_options


class WeightRoutes:
    """Pushes the policy trainer's weights to the generators (see the module docstring).

    Args:
        plan: the transport and the layout (``Topology.weight_sync``).
        policy: the policy handle (its train engines send).
        rollout: the generators' handle.
        generate_engine: the generators' engine name and options (a broadcast counts their
            processes: ``workers_per_engine``).
    """

    def __init__(self, plan: WeightSyncPlan, policy: ModelHandle, rollout: ModelHandle,
                 generate_engine: tuple[str, object] | None = None):
        self.plan, self.policy, self.rollout, self.generate_engine = plan, policy, rollout, generate_engine
        self.kind = check_options(plan.transport, plan.options).kind
        self.epoch = 0
        """Counts complete syncs; a sync that sees it move (a generator restarted and re-synced
        while it ran) stops: the restart's sync was whole."""
        self.syncing = False
        """Whether a sync is under way: a broadcast's sender may then be blocked in the collective
        with a generator that died, so that generator cannot be restarted alone."""

    @property
    def transport(self) -> str:
        return self.plan.transport

    def setup(self) -> str:
        """Build every worker's side of the transport; returns the transport's name."""
        name, common = self.plan.transport, dict(self.plan.options)
        if self.plan.colocated:
            if self.rollout.world_size != self.policy.world_size:
                raise WeightSyncError(f"co-located generators: {self.rollout.world_size} for {self.policy.world_size} "
                                      f"policy ranks; each policy rank sends to the generator of its own bundle")
            senders = receivers = [common] * self.policy.world_size
        else:
            senders, receivers = [common], [dict(common) for _ in self.rollout.workers]
            if self.kind == "broadcast":
                host, port = self.policy._get([self.policy.workers[0].address.remote()], [0])[0]
                name_, options = self.generate_engine
                tp = engine_class(name_, "generate").workers_per_engine(options)  # processes per generator
                group = {"host": host, "port": port, "world_size": 1 + tp * self.rollout.world_size}
                senders = [{**common, **group, "rank": 0}]
                receivers = [{**o, **group, "rank": 1 + tp * r} for r, o in enumerate(receivers)]
        refs = [w.set_transport.remote(o, name) for w, o in zip(self.policy.workers, senders)]
        refs += [w.set_transport.remote(o, name) for w, o in zip(self.rollout.workers, receivers)]
        ray.get(refs)
        if self.kind == "broadcast" and not self.plan.colocated:
            # the group opens now, every side at once, while the GPUs are free: opened at the first
            # sync, NCCL found the trainer's GPU full of its cached activations ("unhandled cuda error")
            ray.get([w.connect_transport.remote() for w in self.policy.workers[:len(senders)]]
                    + [w.connect_transport.remote() for w in self.rollout.workers])
        return name

    def sync(self, version: int | None = None) -> float:
        """One sync of the policy's current weights (``version``: their policy version, stamped
        on the tokens the generators sample with them); returns seconds taken.

        A generator that dies during it is restarted in place by the coordinator, which syncs it
        whole (``Coordinator.heal``); the sync's own steps are then not sent again (``redo=False``:
        a bucket sent twice would leave the generator waiting for a sync's end) and it is done."""
        t0 = time.time()
        epoch = self.epoch
        self.syncing = True
        try:
            self._route(epoch, version)
        except WorkerDiedError:
            if self.epoch == epoch:  # no whole re-sync happened: the run must restart
                raise
        finally:
            self.syncing = False
        return time.time() - t0

    def _route(self, epoch: int, version: int | None) -> None:
        if self.plan.colocated:
            self.policy.release_memory()  # the train step's cached blocks, before anything wakes
            self._pairwise(epoch)
        elif self.kind == "broadcast":
            receiving = self.rollout.receive_weights(None, wait=False)  # they wait for the sender's buckets
            helpers = self.policy.join_weight_gather()  # a ZeRO-3 trainer's other ranks gather with rank 0
            sent = self.policy.broadcast_weights(wait=False)
            n_sent = sent.get()
            self._check(n_sent, receiving.get())
            if helpers is not None:
                helpers.get()
        else:
            helpers = self.policy.join_weight_gather()
            messages = self.policy.send_weights(wait=False).refs[0]  # stays in the object store
            self.rollout.receive_weights(messages)  # Ray hands every worker the stored messages
            if helpers is not None:
                helpers.get()
        if self.epoch == epoch:  # (else a restarted generator was synced whole meanwhile)
            if self.plan.colocated:
                self.policy.release_memory()
            self.rollout.end_sync(version)
            self.epoch += 1

    def _pairwise(self, epoch: int) -> None:
        """Each policy rank's buckets to the generator of its bundle, one bucket at a time."""
        self.policy.begin_send()
        while True:
            sending = self.policy.next_message(wait=False)
            loaded = self.rollout.receive_each(sending.refs)  # resolved worker-side: no copy through here
            sending.get()
            if self.epoch != epoch or not any(loaded):
                return

    def _check(self, sent: int, received: list[int]) -> None:
        bad = [r for r, n in enumerate(received) if n != sent]
        if bad:
            raise WeightSyncError(f"weight sync ({self.transport}): rollout rank(s) {bad} received "
                                  f"{[received[r] for r in bad]} tensors of {sent} sent")

    def end_rollout(self) -> None:
        """The rollout is over until the next sync: co-located generators release their memory."""
        if self.plan.colocated:
            self.rollout.sleep_generator()
