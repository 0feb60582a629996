"""Weight routes across Ray workers: which worker sends, which receive, and in what order.

The transports themselves (how a bucket travels) are ``xrlhf.weight_sync``; this module only
decides who sends to whom. Two layouts (docs/vllm.md):

* **co-located** (``policy.generate.resources`` unset): every policy worker hosts a train and
  a generate engine; each rank pushes its own weights to its own generator
  (``sync_weights_local``). ``auto`` is decided in the worker, where it is known whether the
  generator's weights live in the worker's process (HF, or vLLM without multiprocessing:
  ``in_process``) or in another process on the same GPU (vLLM: ``cuda_ipc``). Between the
  rollout and the update the generators sleep (vLLM frees its KV cache, and its weights at
  ``sleep_level: 2``); the sync wakes them.
* **split** (``policy.generate.resources`` set): the generators are a handle of their own,
  ``rollout``, on their own devices. Policy rank 0 sends (every trainer rank holds the same
  weights after a step). A message transport (``cpu``, ``disk``): rank 0's messages go to
  the object store once and every rollout worker reads them from there (``disk``'s messages
  are file paths, so only the paths travel). A broadcast transport (``nccl``): the receivers
  are started first, then the sender, because each bucket is a collective.

Options a transport takes beyond the shared ones (``disk``'s ``directory``) are passed only
when set, and checked against the transport's own signature here, before any worker builds it.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from xrlhf.config.schema import XConfig
from xrlhf.coordinator.handle import ModelHandle
from xrlhf.engines.base import engine_class, engine_options
from xrlhf.weight_sync import WeightSyncError, check_options


class WeightRoutes:
    """Pushes the policy trainer's weights to the generators (see the module docstring).

    Args:
        cfg: the run's config (``policy.weight_sync``, ``policy.generate``).
        policy: the policy handle (train engines; and the generators when co-located).
        rollout: the generators' handle in the split layout, else ``None``.
    """

    def __init__(self, cfg: XConfig, policy: ModelHandle, rollout: ModelHandle | None):
        self.cfg, self.policy, self.rollout = cfg, policy, rollout
        self.transport = ""
        self.kind = "message"

    def setup(self) -> str:
        """Build every worker's side of the transport; returns the transport's name."""
        ws, gen = self.cfg.policy.weight_sync, self.cfg.policy.generate
        common: dict[str, Any] = {"bucket_bytes": ws.bucket_mb << 20, "verify": ws.verify, "dtype": gen.dtype}
        if ws.directory is not None:
            common["directory"] = ws.directory
        if self.rollout is None:
            if ws.transport != "auto":
                check_options(ws.transport, common)
            names = self.policy._get([w.set_transport.remote(ws.transport, common) for w in self.policy.workers],
                                     list(range(self.policy.world_size)))
            self.transport = names[0]
            return self.transport
        gpus = gen.resources.gpus_per_rank > 0
        name = ws.transport if ws.transport != "auto" else ("nccl" if gpus else "cpu")
        self.kind = check_options(name, common).kind
        sender, receivers = dict(common), [dict(common) for _ in self.rollout.workers]
        if self.kind == "broadcast":
            host, port = self.policy._get([self.policy.workers[0].address.remote()], [0])[0]
            options = engine_options(gen.engine, "generate", gen.engine_fields(), "policy.generate")
            tp = engine_class(gen.engine, "generate").workers_per_engine(options)  # processes per generator
            group = {"host": host, "port": port, "world_size": 1 + tp * self.rollout.world_size}
            sender.update(group, rank=0)
            for r, opts in enumerate(receivers):
                opts.update(group, rank=1 + tp * r)
        refs = [self.policy.workers[0].set_transport.remote(name, sender)]
        refs += [w.set_transport.remote(name, o) for w, o in zip(self.rollout.workers, receivers)]
        ray.get(refs)
        self.transport = name
        return name

    def sync(self, version: int | None = None) -> float:
        """One sync of the policy's current weights (``version``: their policy version, stamped
        on the tokens the generators sample with them); returns seconds taken."""
        t0 = time.time()
        if self.rollout is None:
            self.policy.sync_weights_local(version)
        elif self.kind == "broadcast":
            receiving = self.rollout.receive_weights(None, version, wait=False)  # they wait for the sender's buckets
            helpers = self.policy.join_weight_gather()  # a ZeRO-3 trainer's other ranks gather with rank 0
            sent = self.policy.broadcast_weights(wait=False)
            n_sent = sent.get()
            self._check(n_sent, receiving.get())
            if helpers is not None:
                helpers.get()
        else:
            helpers = self.policy.join_weight_gather()
            messages = self.policy.send_weights(wait=False).refs[0]  # stays in the object store
            self.rollout.receive_weights(messages, version)  # Ray hands every worker the stored messages
            if helpers is not None:
                helpers.get()
        return time.time() - t0

    def _check(self, sent: int, received: list[int]) -> None:
        bad = [r for r, n in enumerate(received) if n != sent]
        if bad:
            raise WeightSyncError(f"weight sync ({self.transport}): rollout rank(s) {bad} received "
                                  f"{[received[r] for r in bad]} tensors of {sent} sent")

    def end_rollout(self) -> None:
        """The rollout is over: co-located generators release their memory for training."""
        if self.rollout is None:
            self.policy.sleep_generator()
