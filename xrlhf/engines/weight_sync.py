"""Weight-sync transports: how a train engine's weights reach a generate engine.

A transport has a sender side (``pack``: turn a bucket of ``(name, tensor)`` into a message
that the coordinator moves between processes) and a receiver side (``unpack``: turn a
message back into ``(name, tensor)`` pairs the generate engine loads). Weights travel in
buckets of ``bucket_bytes`` so that no side ever holds a second full copy of the model.

With ``verify`` on, the sender puts a checksum of every tensor (cast to the receiver's
dtype) in the message and ``unpack`` checks it, so a corrupted or mismatched sync stops the
run with the tensor's name.

GPU transports (CUDA IPC, NCCL) live beside these in their own small classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator

import torch

from xrlhf.utils.registry import Registry

TRANSPORTS: Registry[type] = Registry("weight-sync transport")


class WeightSyncError(RuntimeError):
    """The generator's copy of a tensor does not match the trainer's."""


def checksum(t: torch.Tensor) -> float:
    """An order-sensitive float64 checksum of a tensor's values (cheap, on its own device)."""
    flat = t.detach().reshape(-1).double()
    if flat.numel() == 0:
        return 0.0
    w = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64).remainder_(1009).add_(1)
    return float((flat * w).sum())


def buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (one tensor may exceed it)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


@dataclass
class Message:
    """One bucket in transit: names, a transport-specific payload, optional checksums."""

    names: list[str]
    payload: Any
    checksums: list[float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Transport(ABC):
    """Moves buckets of weights from a trainer to a generator.

    Args:
        bucket_bytes: the largest bucket sent at once.
        verify: put checksums in each message and check them on receipt.
        dtype: the receiver's parameter dtype (checksums are taken after casting to it).
    """

    name: ClassVar[str]

    def __init__(self, bucket_bytes: int = 256 << 20, verify: bool = False, dtype: torch.dtype | None = None):
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self.dtype = dtype

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Message]:
        """Sender side: one message per bucket."""
        for bucket in buckets(weights, self.bucket_bytes):
            if self.dtype is not None:
                bucket = [(n, t.detach().to(self.dtype)) for n, t in bucket]
            sums = [checksum(t) for _, t in bucket] if self.verify else None
            yield Message([n for n, _ in bucket], self.pack([t for _, t in bucket]), sums)

    def receive(self, message: Message) -> list[tuple[str, torch.Tensor]]:
        """Receiver side: the bucket's tensors, checked against the sender's checksums."""
        tensors = self.unpack(message)
        if message.checksums is not None:
            for name, t, want in zip(message.names, tensors, message.checksums):
                got = checksum(t)
                if abs(got - want) > 1e-6 * max(1.0, abs(want)):
                    raise WeightSyncError(f"weight sync ({self.name}): tensor {name!r} arrived with checksum "
                                          f"{got!r}, sent {want!r}")
        return list(zip(message.names, tensors))

    @abstractmethod
    def pack(self, tensors: list[torch.Tensor]) -> Any:
        """Sender side: tensors of one bucket -> a payload the coordinator can move."""

    @abstractmethod
    def unpack(self, message: Message) -> list[torch.Tensor]:
        """Receiver side: a message -> the bucket's tensors."""


@TRANSPORTS.register("in_process")
class InProcessTransport(Transport):
    """Trainer and generator in one process: tensors are handed over as they are (no copy)."""

    name = "in_process"

    def pack(self, tensors: list[torch.Tensor]) -> Any:
        return tensors

    def unpack(self, message: Message) -> list[torch.Tensor]:
        return message.payload


@TRANSPORTS.register("cpu")
class CPUTransport(Transport):
    """Any placement: tensors copied to CPU memory and moved by the coordinator (Ray object store)."""

    name = "cpu"

    def pack(self, tensors: list[torch.Tensor]) -> Any:
        return [t.detach().to("cpu", copy=True) for t in tensors]

    def unpack(self, message: Message) -> list[torch.Tensor]:
        return message.payload


def build_transport(name: str, **kwargs) -> Transport:
    """The transport registered as ``name`` (GPU transports are imported on demand)."""
    if name in ("cuda_ipc", "nccl") and name not in TRANSPORTS:
        import importlib

        importlib.import_module("xrlhf.engines.gpu_transports")
    return TRANSPORTS.get(name)(**kwargs)
