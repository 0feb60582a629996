"""Weight-sync transports: how a train engine's weights reach a generate engine.

A transport has a sender side (``send``: the trainer's ``(name, tensor)`` pairs, grouped in
buckets of ``bucket_bytes``, each turned into a ``Message``) and a receiver side
(``receive``: a message back into ``(name, tensor)`` pairs that the generate engine loads).
Buckets bound memory: no side ever holds a second full copy of the model.

Two kinds:

* ``message`` transports (``in_process``, ``cpu``, ``cuda_ipc``): the message carries the data
  (tensors, CPU copies, CUDA IPC handles) and whoever runs the sync moves it to the receiver.
* ``broadcast`` transports (``nccl``): the message carries only names, shapes, dtypes and
  checksums; the data goes by a collective between the trainer (rank 0) and every generator
  worker, so sender and receivers must run at the same time (``receive_all`` on each
  receiver while ``send`` runs on the trainer).

With ``verify`` on, the sender puts a checksum of every tensor (cast to the receiver's dtype)
in the message and ``receive`` checks it where the tensor arrives (inside vLLM's worker for
the vLLM engine), so a corrupted or mismatched sync stops the run with the tensor's name.

The GPU transports (CUDA IPC, NCCL) live in ``xrlhf.engines.gpu_transports``, imported only
when chosen.
"""

from __future__ import annotations

import pickle
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Iterator, Literal

import torch

from xrlhf.utils.registry import Registry

TRANSPORTS: Registry[type] = Registry("weight-sync transport")

NamedTensorList = list[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """The generator's copy of a tensor does not match the trainer's."""


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: torch.Tensor) -> int:
    """An exact, order-sensitive checksum of a tensor's bits, computed on its own device.

    Each element's bits, read as an integer, are multiplied by a hash of its position and
    summed in int64 (wrapping modulo 2**64, so the order of the sum does not matter and a CPU
    and a GPU agree exactly). Equal checksums mean equal bits up to a 2**-64 chance; a single
    flipped bit always changes it.
    """
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    word = _WORDS.get(flat.element_size())
    words = (flat.view(torch.uint8) if word is None or flat.dtype == torch.bool else flat.view(word)).to(torch.int64)
    pos = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
    pos.mul_(2654435761).add_(0x9E3779B9).bitwise_and_(0xFFFFFFFF).bitwise_or_(1)
    return int((words * pos).sum())  # not in place: ``words`` may be the caller's int64 tensor


def checksums_match(got: int, want: int) -> bool:
    """Checksums are exact: bit-equal tensors have equal checksums."""
    return got == want


def compare_checksums(want: dict[str, int], got: dict[str, int], where: str = "generator") -> None:
    """Raise ``WeightSyncError`` naming the first tensors whose checksums differ or are missing."""
    missing = sorted(set(want) - set(got))
    wrong = [n for n in want if n in got and not checksums_match(got[n], want[n])]
    if missing or wrong:
        parts = []
        if wrong:
            parts.append("differ: " + ", ".join(f"{n!r} ({got[n]!r} != {want[n]!r})" for n in wrong[:5]))
        if missing:
            parts.append(f"missing in the {where}: " + ", ".join(map(repr, missing[:5])))
        raise WeightSyncError(f"{where} weights do not match the trainer's ({len(wrong)} differ, "
                              f"{len(missing)} missing): " + "; ".join(parts))


def buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensorList]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (one tensor may exceed it)."""
    bucket: NamedTensorList = []
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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a plain string survives any serializer)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


ALIGN = 16
"""Byte alignment of each tensor inside a flat bucket buffer (any dtype can be viewed there)."""


def flat_layout(tensors: Iterable[torch.Tensor]) -> dict[str, Any]:
    """Where each tensor goes in one flat byte buffer: shapes, dtype names, byte offsets, total.

    Every offset is a multiple of ``ALIGN``, so each slice can be viewed as its dtype.
    """
    shapes, dtypes, offsets = [], [], []
    offset = 0
    for t in tensors:
        shapes.append(list(t.shape))
        dtypes.append(dtype_name(t.dtype))
        offsets.append(offset)
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return {"shapes": shapes, "dtypes": dtypes, "offsets": offsets, "nbytes": offset}


def flatten(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Copy tensors into one contiguous ``uint8`` buffer on their device: ``(buffer, layout)``."""
    layout = flat_layout(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    buf = torch.empty(layout["nbytes"], dtype=torch.uint8, device=device)
    for t, off in zip(tensors, layout["offsets"]):
        n = t.numel() * t.element_size()
        buf[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf, layout


def unflatten(buf: torch.Tensor, layout: dict[str, Any]) -> list[torch.Tensor]:
    """Views into ``buf`` (from ``flatten``), one per tensor, with their shapes and dtypes."""
    out = []
    for shape, name, off in zip(layout["shapes"], layout["dtypes"], layout["offsets"]):
        dtype = dtype_from_name(name)
        numel = 1
        for s in shape:
            numel *= s
        n = numel * torch.empty((), dtype=dtype).element_size()
        out.append(buf[off:off + n].view(dtype).view(shape))
    return out


@dataclass
class Message:
    """One bucket in transit: names, a transport-specific payload, optional checksums."""

    names: list[str]
    payload: Any
    checksums: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Transport(ABC):
    """Moves buckets of weights from a trainer to a generator.

    A transport object is picklable: the receiver side can be rebuilt from a copy in another
    process (a vLLM worker). Attributes whose names start with ``_`` are live state of one
    side (open connections, tensors kept alive) and are not pickled.

    Args:
        bucket_bytes: the largest bucket sent at once.
        verify: put checksums in each message and check them on receipt.
        dtype: the receiver's parameter dtype (tensors are cast, and checksums taken, after it).
    """

    name: ClassVar[str]
    kind: ClassVar[Literal["message", "broadcast"]] = "message"

    def __init__(self, bucket_bytes: int = 256 << 20, verify: bool = False, dtype: torch.dtype | None = None):
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self.dtype = dtype

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def peer(self) -> "Transport":
        """A fresh copy for the other side of a sync run from this process (tests, benchmarks)."""
        return pickle.loads(pickle.dumps(self))

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Message]:
        """Sender side: one message per bucket.

        The caller must have finished with a message (delivered it and had it loaded) before
        asking for the next one: transports that share memory keep a bucket's tensors alive
        only until then.
        """
        for bucket in buckets(weights, self.bucket_bytes):
            tensors = [t.detach() if self.dtype is None else t.detach().to(self.dtype) for _, t in bucket]
            sums = [checksum(t) for t in tensors] if self.verify else None
            yield Message([n for n, _ in bucket], self.pack(tensors), sums, self.describe(tensors))

    def receive(self, message: Message, device: torch.device | str | None = None) -> NamedTensorList:
        """Receiver side: the bucket's tensors, checked against the sender's checksums.

        Args:
            message: one bucket from ``send``.
            device: where the receiver's weights live (transports that map memory need it).

        Raises:
            WeightSyncError: naming the first tensor whose checksum differs.
        """
        tensors = self.unpack(message, None if device is None else torch.device(device))
        if len(tensors) != len(message.names):
            raise WeightSyncError(f"weight sync ({self.name}): {len(tensors)} tensors arrived for "
                                  f"{len(message.names)} names")
        if message.checksums is not None:
            for name, t, want in zip(message.names, tensors, message.checksums):
                got = checksum(t)
                if not checksums_match(got, want):
                    raise WeightSyncError(f"weight sync ({self.name}): tensor {name!r} arrived with checksum "
                                          f"{got!r}, sent {want!r}")
        return list(zip(message.names, tensors))

    def receive_all(self, messages: Iterable[Message] | None, device: torch.device | str | None = None,
                    rank_offset: int = 0) -> Iterator[NamedTensorList]:
        """Receiver side of a whole sync (or part of one), bucket by bucket.

        Args:
            messages: the messages of a ``message`` transport; ``None`` for a ``broadcast``
                transport, whose buckets come from the collective.
            device: where the receiver's weights live.
            rank_offset: added to the transport's receiver rank (tensor-parallel workers of
                one generator engine); ``broadcast`` transports only.
        """
        if messages is None:
            raise ValueError(f"weight sync ({self.name}): a message transport needs the messages")
        for message in messages:
            yield self.receive(message, device)

    @abstractmethod
    def pack(self, tensors: list[torch.Tensor]) -> Any:
        """Sender side: tensors of one bucket -> a payload the coordinator can move."""

    def describe(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """Sender side: a bucket's ``Message.meta`` (what the receiver needs besides the payload)."""
        return {}

    @abstractmethod
    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        """Receiver side: a message -> the bucket's tensors."""


@TRANSPORTS.register("in_process")
class InProcessTransport(Transport):
    """Trainer and generator in one process: tensors are handed over as they are (no copy)."""

    name = "in_process"

    def pack(self, tensors: list[torch.Tensor]) -> Any:
        return tensors

    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        return message.payload


@TRANSPORTS.register("cpu")
class CPUTransport(Transport):
    """Any placement: tensors copied to CPU memory and moved by the coordinator (Ray object store)."""

    name = "cpu"

    def pack(self, tensors: list[torch.Tensor]) -> Any:
        return [t.to("cpu", copy=True) for t in tensors]

    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        return message.payload


def build_transport(name: str, **kwargs) -> Transport:
    """The transport registered as ``name`` (GPU transports are imported on demand)."""
    if name in ("cuda_ipc", "nccl") and name not in TRANSPORTS:
        import importlib

        importlib.import_module("xrlhf.engines.gpu_transports")
    return TRANSPORTS.get(name)(**kwargs)


Receiver = Callable[[Transport, "list[Message] | None"], int]
"""``receiver(transport, messages)`` loads what arrives and returns the number of tensors;
``GenerateEngine.receive_weights`` has this shape."""


def push_weights(transport: Transport, weights: Iterable[tuple[str, torch.Tensor]], receiver: Receiver) -> int:
    """One whole sync where sender and receiver are both driven from this process.

    Message transports: each bucket is handed to ``receiver`` before the next is packed (so a
    bucket's shared memory is released before the next is exported). Broadcast transports:
    ``receiver`` runs in a thread with its own copy of the transport (``peer``), at the same
    time as the sender, because a collective needs both sides.

    Returns:
        the number of tensors the receiver loaded.
    """
    if transport.kind == "message":
        return sum(receiver(transport, [m]) for m in transport.send(weights))
    result: dict[str, Any] = {}
    other = getattr(transport, "_peer", None) or transport.peer()
    transport._peer = other  # the receiver keeps its connection from one sync to the next

    def run() -> None:
        try:
            result["n"] = receiver(other, None)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="xrlhf-weight-receiver", daemon=True)
    thread.start()
    for _ in transport.send(weights):  # if this raises, the receiver times out on its own
        pass
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["n"]
