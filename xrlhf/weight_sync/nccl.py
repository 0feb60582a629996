"""``nccl``: a broadcast from the trainer to every generator worker on other GPUs (split layout).

The trainer (rank 0) and every generator worker (ranks 1..N) form a process group of their
own, stateless, beside any torch.distributed world they are already in (vLLM's
``StatelessProcessGroup`` + ``PyNcclCommunicator``; NCCL cannot put two ranks on one GPU).
Per bucket the trainer copies the tensors into one flat buffer, puts the bucket's names,
shapes, dtypes and checksums in the group's TCP store, and broadcasts the buffer; each
receiver reads the metadata, receives into an empty buffer of the right size and splits it
into views. A ``None`` in the store ends the sync. The group is opened by the first sync and
kept (``setup_seconds`` says how long opening it took: it is not part of a sync's cost). On
CPU the same transport runs over gloo, so its orchestration is tested without a GPU.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any, Iterable, Iterator

import torch

from xrlhf.weight_sync.base import (TRANSPORTS, Message, NamedTensorList, Transport, WeightSyncError, cuda_device,
                                     flat_layout, flatten, unflatten)


class _GlooGroup:
    """CPU stand-in for the NCCL group: a TCP store for metadata, gloo for the buffers."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.pg = ProcessGroupGloo(PrefixStore("xrlhf-weights/", self.store), rank, world_size, timeout)
        self.counter = 0

    def broadcast_obj(self, obj: Any) -> Any:
        key = f"xrlhf-msg/{self.counter}"
        self.counter += 1
        if self.rank == 0:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))

    def broadcast(self, t: torch.Tensor) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()


class _NcclGroup:
    """vLLM's stateless group (TCP store) for metadata and its PyNccl communicator for buffers."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                               store_timeout=int(timeout_s))
        self.comm = PyNcclCommunicator(self.pg, device=device)
        if self.comm.disabled:
            raise WeightSyncError("weight sync (nccl): vLLM's NCCL communicator is disabled "
                                  "(VLLM_DISABLE_PYNCCL set, no NCCL library, or a group of one)")
        self.device = device

    def broadcast_obj(self, obj: Any) -> Any:
        return self.pg.broadcast_obj(obj, src=0)

    def broadcast(self, t: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device)
        self.comm.broadcast(t, src=0, stream=stream)
        stream.synchronize()


@TRANSPORTS.register("nccl")
class NCCLTransport(Transport):
    """Different GPUs: broadcast from the trainer (rank 0) to every generator worker.

    Args:
        host, port: where rank 0 (the trainer) opens the group's TCP store.
        world_size: 1 + the number of generator workers (tensor-parallel ones included).
        rank: this side's rank: 0 for the trainer, ``1 + ...`` for a generator engine's first
            worker (its tensor-parallel workers add their ``rank_offset``).
        timeout_s: how long a side waits for the others (first connection, each bucket).
    """

    name = "nccl"
    kind = "broadcast"
    # (on CPU the same protocol runs over gloo: the split layout's CPU tests use it)

    def __init__(self, bucket_bytes: int = 256 << 20, verify: bool = False, dtype: torch.dtype | None = None,
                 host: str = "127.0.0.1", port: int = 0, world_size: int = 2, rank: int = 0,
                 timeout_s: float = 600.0):
        super().__init__(bucket_bytes, verify, dtype)
        self.host, self.port, self.world_size, self.rank, self.timeout_s = host, port, world_size, rank, timeout_s

    def _connect(self, rank: int, device: torch.device):
        group = getattr(self, "_group", None)
        if group is None:
            t0 = time.perf_counter()  # includes waiting for the other ranks to arrive
            if device.type == "cuda":
                group = _NcclGroup(self.host, self.port, rank, self.world_size, self.timeout_s, cuda_device(device))
            else:
                group = _GlooGroup(self.host, self.port, rank, self.world_size, self.timeout_s)
            self._group, self._setup_s = group, time.perf_counter() - t0
        return group

    @property
    def setup_seconds(self) -> float | None:
        """How long this side took to open the group (``None`` before the first sync)."""
        return getattr(self, "_setup_s", None)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Message]:
        """Broadcast every bucket; yields each bucket's metadata message once it has gone."""
        if self.rank != 0:
            raise WeightSyncError(f"weight sync (nccl): only rank 0 sends, this side is rank {self.rank}")
        device = torch.device("cpu")
        for message in super().send(weights):
            buf, message.payload = message.payload, None
            device = buf.device
            group = self._connect(0, device)
            group.broadcast_obj(message)
            group.broadcast(buf)
            yield message
        self._connect(0, device).broadcast_obj(None)

    def peer(self, rank: int = 1) -> "NCCLTransport":
        copy = super().peer()
        copy.rank = rank
        return copy

    def pack(self, tensors: list[torch.Tensor], names: list[str], index: int) -> Any:
        return flatten(tensors)[0]

    def describe(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        return flat_layout(tensors)

    def connect(self, device: torch.device | str | None = None, rank_offset: int = 0) -> None:
        """Open the group (every rank at once, else each waits up to ``timeout_s``)."""
        self._connect(self.rank + rank_offset, self._device(device))

    @staticmethod
    def _device(device: torch.device | str | None) -> torch.device:
        device = torch.device(device) if device is not None else torch.device("cpu")
        return cuda_device(device) if device.type == "cuda" else device

    def receive_all(self, messages: Iterable[Message] | None = None, device: torch.device | str | None = None,
                    rank_offset: int = 0, checked: dict[str, int] | None = None) -> Iterator[NamedTensorList]:
        """Receive buckets until the sender's end marker (``messages`` is ignored)."""
        device = self._device(device)
        group = self._connect(self.rank + rank_offset, device)
        while True:
            message = group.broadcast_obj(None)
            if message is None:
                return
            buf = torch.empty(message.meta["nbytes"], dtype=torch.uint8, device=device)
            group.broadcast(buf)
            message.payload = buf
            yield self.receive(message, device, checked)

    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        return unflatten(message.payload, message.meta)
