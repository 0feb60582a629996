"""``cpu``: weights through host memory, moved by the coordinator (Ray's object store) or by
pickle into vLLM's engine process. Works in any placement, GPUs or not.

Why one flat buffer per bucket. Sending each tensor copied to the CPU as a list is slow at every
step, for one reason, many small pageable objects (measured: docs/vllm.md, "Transports"): each device-to-host copy into fresh pageable memory goes through a driver
bounce buffer and waits on its own; pickling a torch tensor serializes its storage through
``torch.save`` into a ``BytesIO`` (several copies, per tensor); and unpickling copies again.
Now the sender copies a bucket into one reusable *pinned* buffer (non-blocking copies at bus
speed, one wait per bucket) and sends it as a numpy ``uint8`` array plus its layout: Ray
stores a numpy array as one out-of-band buffer (written once, read without a copy) and plain
pickle writes it as one ``bytes``. The receiver views its tensors in the buffer
(``unflatten``); the loader's copy into the parameters is the only one left on that side.
docs/design/probes.md has the two paths measured on CPU.

A message's data is valid until the same bucket of the next sync is packed (the pinned
buffers are reused): the coordinator's object store copies it before then. Into vLLM's engine
process on the same host nothing is copied: the host buffers are files in ``/dev/shm``
(``SharedFiles``), page-locked with ``cudaHostRegister``, and ``local`` sends the file's name;
the receiver maps it and the loader copies from it to the GPU.
The receiver's tensors may be read-only views of the object store: loaders only read them.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from xrlhf.weight_sync.base import TRANSPORTS, Message, Transport, flat_layout, unflatten
from xrlhf.weight_sync.memory import HostBuffers, SharedFiles, map_shared


def as_array(buf: torch.Tensor):
    """A CPU ``uint8`` tensor as a numpy array sharing its memory (what serializers move fastest)."""
    return buf.numpy()


def from_array(data) -> torch.Tensor:
    """A ``uint8`` buffer (numpy array, bytes, memoryview) as a tensor, without a copy.

    A buffer from Ray's object store is read-only; torch warns about that once per process,
    but nothing here writes to it (checksums and loaders read), so the warning is silenced.
    """
    if isinstance(data, torch.Tensor):
        return data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8) if len(memoryview(data)) else torch.empty(0, dtype=torch.uint8)


@TRANSPORTS.register("cpu")
class CPUTransport(Transport):
    """Any placement: each bucket as one flat host buffer (pinned when the weights are on a GPU)."""

    name = "cpu"

    def pack(self, tensors: list[torch.Tensor], names: list[str], index: int) -> Any:
        if getattr(self, "_host", None) is None:
            self._host = HostBuffers(SharedFiles())
        buf, _ = self._host.stage(index, tensors)
        self._staged = self._host.path(index)  # for ``describe``, called next for this bucket
        return as_array(buf)

    def describe(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        shared = getattr(self, "_staged", None)
        return {**flat_layout(tensors), **({"shm": shared} if shared else {})}

    def close(self) -> None:
        host = getattr(self, "_host", None)
        if host is not None:
            host.close()
        self._host = None

    def local(self, message: Message) -> Message:
        """Within one host the bucket's shared-memory file is named, not sent: the receiver maps
        the pinned buffer the trainer copied into (no copy between the processes)."""
        return dataclasses.replace(message, payload=None) if "shm" in message.meta else message

    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        data = message.payload
        if data is None:  # sent by ``local``: map the sender's buffer
            data = map_shared(message.meta["shm"], message.meta["nbytes"])
        return unflatten(from_array(data), message.meta)
