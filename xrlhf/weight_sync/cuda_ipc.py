"""``cuda_ipc``: trainer and generator on one GPU in different processes (co-located vLLM).

The trainer exports a CUDA IPC handle for each tensor of a bucket (no copy: the handles point
into the trainer's own parameters) and the generator's process maps them and copies them into
its weights. The handles are keyed by the GPU's UUID, because the device *index* in a handle
is in the sender's ``CUDA_VISIBLE_DEVICES`` numbering (Ray gives every actor its own): the
receiver checks the UUID is its own GPU's and rewrites the index. The sender keeps a bucket's
tensors alive until the receiver has loaded them (``Transport.send``'s contract: the next
bucket is asked for only then). A process cannot map its own handles, so an in-process vLLM
engine uses ``in_process`` instead.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Iterable, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field

from xrlhf.weight_sync.base import TRANSPORTS, Message, Transport, WeightSyncError, cuda_device, flatten, unflatten


_TOKEN = secrets.token_hex(8)


def process_key() -> str:
    """This process, as a receiver can tell it from any other on the host: the pid (a forked child
    has its own) and a token drawn at import (another PID namespace draws another)."""
    return f"{os.getpid()}-{_TOKEN}"


def gpu_uuid(device: torch.device) -> str:
    """The UUID of the physical GPU behind ``device`` (the same in every process)."""
    return str(torch.cuda.get_device_properties(device).uuid)


class CUDAIPCOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    packed: bool = Field(False, description="one flat buffer (one IPC mapping) per bucket, at the cost of a "
                         "device-to-device copy, instead of one zero-copy handle per tensor")


@TRANSPORTS.register("cuda_ipc")
class CUDAIPCTransport(Transport):
    """Same GPU, different processes: CUDA IPC handles, a bucket per message.

    Args:
        packed: copy each bucket into one flat buffer and send a single handle for it (one
            IPC mapping per bucket, at the cost of a device-to-device copy) instead of one
            zero-copy handle per tensor.
    """

    name = "cuda_ipc"
    reach = "gpu"
    needs_gpu = True
    Options = CUDAIPCOptions

    def __init__(self, bucket_bytes: int = 256 << 20, verify: bool = False, dtype: torch.dtype | None = None,
                 packed: bool = False):
        super().__init__(bucket_bytes, verify, dtype)
        self.packed = packed

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Message]:
        try:
            for message in super().send(weights):
                yield message
                self._keep = None  # the receiver has loaded this bucket
        finally:
            self._keep = None
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.ipc_collect()

    def pack(self, tensors: list[torch.Tensor], names: list[str], index: int) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        if any(t.device.type != "cuda" for t in tensors):
            raise WeightSyncError("weight sync (cuda_ipc): the trainer's weights are not on a GPU; "
                                  "use policy.weight_sync.transport: cpu")
        uuid = gpu_uuid(tensors[0].device)
        if self.packed:
            buf, layout = flatten(tensors)
            self._keep = buf
            return {"uuid": uuid, "process": process_key(), "handles": [reduce_tensor(buf)[1]], "layout": layout}
        self._keep = tensors
        return {"uuid": uuid, "process": process_key(), "handles": [reduce_tensor(t)[1] for t in tensors]}

    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if message.payload.get("process") == process_key():
            raise WeightSyncError("weight sync (cuda_ipc): the trainer is this process, and a process cannot map its "
                                  "own CUDA IPC handles; use transport in_process here, or put vLLM's engine core "
                                  "in a process of its own (policy.generate.multiprocessing: true)")
        device = cuda_device(device)
        mine = gpu_uuid(device)
        if mine != message.payload["uuid"]:
            raise WeightSyncError(f"weight sync (cuda_ipc): the trainer is on GPU {message.payload['uuid']} and "
                                  f"the generator on GPU {mine}; CUDA IPC needs both on one GPU "
                                  f"(use transport nccl or cpu)")
        tensors = []
        for args in message.payload["handles"]:
            args = list(args)
            args[6] = device.index  # the sender's device index means nothing here
            tensors.append(rebuild_cuda_tensor(*args))
        if "layout" in message.payload:
            return unflatten(tensors[0], message.payload["layout"])
        return tensors
