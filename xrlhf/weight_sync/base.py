"""What every weight-sync transport shares: buckets, flat buffers, checksums, the read-back.

A transport has a sender side (``send``: the trainer's ``(name, tensor)`` pairs, grouped in
buckets of ``bucket_bytes``, each turned into a ``Message``) and a receiver side
(``receive``: a message back into ``(name, tensor)`` pairs that the generate engine loads).
Buckets bound memory: no side ever holds a second full copy of the model on the accelerator.

Two kinds:

* ``message`` transports (``in_process``, ``cpu``, ``cuda_ipc``, ``disk``): the message
  carries the data (tensors, a host buffer, CUDA IPC handles, a file's path) and whoever runs
  the sync moves it to the receiver.
* ``broadcast`` transports (``nccl``): the message carries only names, shapes, dtypes and
  checksums; the data goes by a collective between the trainer (rank 0) and every generator
  worker, so sender and receivers must run at the same time (``receive_all`` on each
  receiver while ``send`` runs on the trainer).

With ``verify`` on, the sender puts a checksum of every tensor (cast to the receiver's dtype)
in the message and ``receive`` checks it where the tensor arrives (inside vLLM's worker for
the vLLM engine), so a corrupted or mismatched sync stops the run with the tensor's name.

Read-back (``LoadRecord``): a test or benchmark asks the generator afterwards which weights it
holds. A loader may change a tensor's layout (vLLM fuses q/k/v, transposes GPT-2's Conv1D), so
the receiver keeps, for a verified sync, the checksum of each tensor *as the loader was given it*
(the trainer's layout) and of every parameter right after the sync; the read-back checks the
latter still hold, then returns the former. Why this design: docs/vllm.md ("Transports").

Transports are plug-ins of the lazy ``TRANSPORTS`` registry: one module of this package per
transport, imported when its name is asked for, so the GPU transports' imports cost nothing
until chosen and nothing here lists them.
"""

from __future__ import annotations

import inspect
import pickle
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from xrlhf.utils.registry import Registry

TRANSPORTS: Registry[type] = Registry("weight-sync transport", package="xrlhf.weight_sync", skip=("base", "memory"))

NamedTensorList = list[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """The generator's copy of a tensor does not match the trainer's."""


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_CHUNK = 1 << 24
"""Elements a checksum reads per pass: its int64 temporaries stay under ~400 MB however large the
tensor (a 7B model's embedding would otherwise need three int64 copies of 0.5G elements)."""


def checksum(t: torch.Tensor) -> int:
    """An exact, order-sensitive checksum of a tensor's bits, computed on its own device.

    Each element's bits, read as an integer, are multiplied by a hash of its position and
    summed in int64 (wrapping modulo 2**64, so the order of the sum does not matter and a CPU
    and a GPU agree exactly). Equal checksums mean equal bits up to a 2**-64 chance; a single
    flipped bit always changes it.
    """
    return checksums([t])[0]


def checksums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """``checksum`` of each tensor, with one wait for the device per device, not one per tensor.

    ``tensors`` may be a generator: each is reduced to a 0-d sum before the next is drawn, so
    converted copies (``t.to(dtype) for ...``) never pile up.
    """
    sums = [_device_checksum(t) for t in tensors]
    out: list[int] = [0] * len(sums)
    for device in {s.device for s in sums}:
        at = [i for i, s in enumerate(sums) if s.device == device]
        for i, v in zip(at, torch.stack([sums[i] for i in at]).tolist()):
            out[i] = v
    return out


def checksums_by_name(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """``{name: checksum}`` of ``(name, tensor)`` pairs, drawn one at a time (``checksums``)."""
    names: list[str] = []

    def tensors() -> Iterator[torch.Tensor]:
        for name, t in named:
            names.append(name)
            yield t

    sums = checksums(tensors())
    return dict(zip(names, sums))


def _device_checksum(t: torch.Tensor) -> torch.Tensor:
    """``checksum(t)`` as a 0-d int64 tensor on ``t``'s device, in passes of ``_CHUNK`` elements."""
    flat = t.detach().contiguous().reshape(-1)
    word = _WORDS.get(flat.element_size())
    words = flat.view(torch.uint8) if word is None or flat.dtype == torch.bool else flat.view(word)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK].to(torch.int64, copy=True)  # a copy: ``words`` may be the caller's
        pos = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64)
        pos.mul_(2654435761).add_(0x9E3779B9).bitwise_and_(0xFFFFFFFF).bitwise_or_(1)
        total.add_(part.mul_(pos).sum())
    return total


def compare_checksums(want: dict[str, int], got: dict[str, int], where: str = "generator") -> None:
    """Raise ``WeightSyncError`` naming the first tensors whose checksums differ or are missing.

    Checksums are exact (bit-equal tensors, equal checksums), so they are compared with ``==``.
    """
    missing = sorted(set(want) - set(got))
    wrong = [n for n in want if n in got and got[n] != want[n]]
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


def flatten(tensors: list[torch.Tensor], out: torch.Tensor | None = None,
            pinned: bool | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Copy tensors into one contiguous ``uint8`` buffer: ``(buffer, layout)``.

    Args:
        tensors: any devices and dtypes.
        out: a ``uint8`` buffer of at least the layout's ``nbytes`` to copy into (e.g. pinned
            host memory: GPU tensors are then copied without blocking, and waited for once at
            the end); default: a new buffer on the first tensor's device.

    Returns:
        ``buffer``: ``[layout["nbytes"]]`` uint8 (a view of ``out`` when given); ``layout``: see
        ``flat_layout``.
        pinned: whether ``out`` is page-locked (default: ``out.is_pinned()``; memory pinned with
            ``cudaHostRegister`` is known to the caller).
    """
    layout = flat_layout(tensors)
    if out is None:
        device = tensors[0].device if tensors else torch.device("cpu")
        buf = torch.empty(layout["nbytes"], dtype=torch.uint8, device=device)
    else:
        buf = out[:layout["nbytes"]]
    if pinned is None:
        pinned = buf.device.type == "cpu" and buf.is_pinned()
    async_from = set()
    for t, off in zip(tensors, layout["offsets"]):
        n = t.numel() * t.element_size()
        non_blocking = pinned and t.device.type == "cuda"
        buf[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=non_blocking)
        if non_blocking:
            async_from.add(t.device)
    for device in async_from:  # one wait per device instead of one per tensor
        torch.cuda.current_stream(device).synchronize()
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


def cuda_device(device: torch.device | None) -> torch.device:
    """``device`` with its index filled in (the current GPU when ``device`` is not a GPU)."""
    if device is None or device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


@dataclass
class Message:
    """One bucket in transit: names, a transport-specific payload, optional checksums."""

    names: list[str]
    payload: Any
    checksums: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Transport(ABC):
    """Moves buckets of weights from a trainer to a generator.

    A transport object is picklable: the receiver side can be rebuilt from a copy in another
    process (a vLLM worker). Attributes whose names start with ``_`` are live state of one
    side (open connections, buffers, tensors kept alive) and are not pickled.

    Args:
        bucket_bytes: the largest bucket sent at once.
        verify: put checksums in each message and check them on receipt.
        dtype: the receiver's parameter dtype (tensors are cast, and checksums taken, after it).
    """

    name: ClassVar[str]
    kind: ClassVar[Literal["message", "broadcast"]] = "message"
    reach: ClassVar[Literal["process", "gpu", "cluster"]] = "cluster"
    """Where sender and receiver may be: one process (``in_process``), two processes on one GPU
    (``cuda_ipc``), anywhere the transport's medium reaches (``cpu``: Ray's object store;
    ``disk``: a directory both see; ``nccl``: GPUs of a network)."""
    needs_gpu: ClassVar[bool] = False
    Options: ClassVar[type[BaseModel]] = NoOptions
    """The options a config may set in ``policy.weight_sync`` for this transport (besides
    ``transport``, ``bucket_mb`` and ``verify``); the others are wired by the coordinator."""

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
        for index, bucket in enumerate(buckets(weights, self.bucket_bytes)):
            tensors = [t.detach() if self.dtype is None else t.detach().to(self.dtype) for _, t in bucket]
            sums = checksums(tensors) if self.verify else None
            names = [n for n, _ in bucket]
            yield Message(names, self.pack(tensors, names, index), sums, self.describe(tensors))

    def connect(self, device: torch.device | str | None = None, rank_offset: int = 0) -> None:
        """Open this side's connection now rather than at the first sync (``device``: where its
        buffers live; ``rank_offset``: a tensor-parallel worker's offset). The coordinator calls
        it on every side at once while wiring, when the GPUs are still free: a broadcast group's
        buffers are then allocated before the trainer's caches fill its GPU. Default: nothing."""

    def close(self) -> None:
        """Free this side's resources that outlive the process otherwise (shared-memory files).
        Default: nothing."""

    def local(self, message: Message) -> Message:
        """``message`` for a receiver in another process on this host (vLLM's engine process):
        a transport whose data already sits in shared memory sends only where it is. Default:
        the message as it is."""
        return message

    def receive(self, message: Message, device: torch.device | str | None = None,
                checked: dict[str, int] | None = None) -> NamedTensorList:
        """Receiver side: the bucket's tensors, checked against the sender's checksums.

        Args:
            message: one bucket from ``send``.
            device: where the receiver's weights live (transports that map memory need it).
            checked: if given, the checksum of every tensor verified here goes in, by name
                (the read-back's record of what the loader was given; see ``LoadRecord``).

        Raises:
            WeightSyncError: naming the first tensor whose checksum differs.
        """
        tensors = self.unpack(message, None if device is None else torch.device(device))
        if len(tensors) != len(message.names):
            raise WeightSyncError(f"weight sync ({self.name}): {len(tensors)} tensors arrived for "
                                  f"{len(message.names)} names")
        if message.checksums is not None:
            if device is not None and torch.device(device).type != "cpu":
                # checked where the weights go: a bucket in host memory (``cpu``, ``disk``) would be
                # read on the host, by one thread inside vLLM's process (vLLM sets its torch so)
                tensors = [t.to(device) if t.device.type == "cpu" else t for t in tensors]
            for name, got, want in zip(message.names, checksums(tensors), message.checksums):
                if got != want:
                    raise WeightSyncError(f"weight sync ({self.name}): tensor {name!r} arrived with checksum "
                                          f"{got!r}, sent {want!r}")
            if checked is not None:
                checked.update(zip(message.names, message.checksums))
        return list(zip(message.names, tensors))

    def receive_all(self, messages: Iterable[Message] | None, device: torch.device | str | None = None,
                    rank_offset: int = 0, checked: dict[str, int] | None = None) -> Iterator[NamedTensorList]:
        """Receiver side of a whole sync (or part of one), bucket by bucket.

        Args:
            messages: the messages of a ``message`` transport; ``None`` for a ``broadcast``
                transport, whose buckets come from the collective.
            device: where the receiver's weights live.
            rank_offset: added to the transport's receiver rank (tensor-parallel workers of
                one generator engine); ``broadcast`` transports only.
            checked: see ``receive``.
        """
        if messages is None:
            raise ValueError(f"weight sync ({self.name}): a message transport needs the messages")
        for message in messages:
            yield self.receive(message, device, checked)

    @abstractmethod
    def pack(self, tensors: list[torch.Tensor], names: list[str], index: int) -> Any:
        """Sender side: bucket number ``index`` of a sync (its tensors, cast to ``dtype``, and
        their names) -> a payload the coordinator can move."""

    def describe(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """Sender side: a bucket's ``Message.meta`` (what the receiver needs besides the payload)."""
        return {}

    @abstractmethod
    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        """Receiver side: a message -> the bucket's tensors."""


def check_options(name: str, options: dict[str, Any]) -> type:
    """The class registered as ``name``, after checking it takes every one of ``options``.

    Each transport declares its options in its own signature (``disk``: ``directory``;
    ``nccl``: ``host``, ``port`` ...), so one it does not take is an error that lists those it
    does, before any worker builds it.

    Raises:
        KeyError: an unknown name (listing the valid ones).
        ValueError: an option the transport does not take.
    """
    cls = TRANSPORTS.get(name)
    params = inspect.signature(cls).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise ValueError(f"policy.weight_sync: transport {name!r} takes no option {', '.join(map(repr, unknown))} "
                             f"(its options: {', '.join(params)}); remove it or choose a transport that takes it")
    return cls


def choose_transport(name: str, colocated: bool, gpu: bool) -> str:
    """``name``, or for ``auto`` the transport of the layout: generators in the policy's bundles
    get ``cuda_ipc`` on a GPU (the trainer's own memory, no copy) and ``cpu`` otherwise; generators
    of their own get ``nccl`` between GPUs and ``cpu`` otherwise. The one place ``auto`` is decided."""
    if name != "auto":
        return name
    if colocated:
        return "cuda_ipc" if gpu else "cpu"
    return "nccl" if gpu else "cpu"


def transport_errors(name: str, own: dict[str, Any], colocated: bool, gpu: bool) -> list[str]:
    """Problems of ``policy.weight_sync`` for a run whose generators are separate workers,
    ``colocated`` with the trainer's bundles or not, on GPUs or not (each line: the path and the fix)."""
    where = "policy.weight_sync.transport"
    try:
        cls = TRANSPORTS.get(choose_transport(name, colocated, gpu))
    except KeyError as e:
        return [f"{where}: {e.args[0]} (or auto)"]
    errors = []
    layout = "co-located (policy.generate.resources unset)" if colocated else "split (policy.generate.resources set)"
    if cls.reach == "process":
        errors.append(f"{where}: {cls.name} hands tensors over inside one process, but a run's generators are "
                      f"workers of their own; use auto")
    elif cls.reach == "gpu" and not (colocated and gpu):
        errors.append(f"{where}: {cls.name} needs trainer and generator on one GPU (the co-located layout with "
                      f"policy.resources.gpus_per_rank > 0); the layout is {layout}: use auto")
    if cls.needs_gpu and not gpu:
        errors.append(f"{where}: {cls.name} needs GPUs (policy.resources.gpus_per_rank); use auto")
    elif cls.kind == "broadcast" and colocated and gpu:
        errors.append(f"{where}: {cls.name} broadcasts between devices, but the {layout} layout puts trainer and "
                      f"generator on one (NCCL cannot have two ranks on a GPU); use auto, or set "
                      f"policy.generate.resources")
    try:
        cls.Options(**own)
    except ValidationError as e:
        errors += [f"policy.weight_sync.{'.'.join(map(str, err['loc']))}: {err['msg']} (transport {cls.name!r}; "
                   f"its options: {', '.join(cls.Options.model_fields) or 'none'})" for err in e.errors()]
    return errors


def build_transport(name: str, **options) -> Transport:
    """The transport registered as ``name`` (its module imported now), built with ``options``
    (checked by ``check_options``)."""
    return check_options(name, options)(**options)


class LoadRecord:
    """A receiver's record of its last sync, for the read-back (see the module docstring).

    During a sync, ``checked`` is passed to ``Transport.receive_all`` and collects the
    checksum of every tensor verified on arrival. ``end_sync`` then keeps, for a sync whose
    every bucket was verified, ``given`` (HF name -> checksum of the tensor handed to the
    loader: the trainer's, in the trainer's layout) and ``made`` (parameter name -> checksum of
    the parameter after the sync: the loader's output, in the generator's own layout). Only a
    verified sync is recorded: its checksums come free, and an unverified one must not leave
    a stale record behind.
    """

    def __init__(self) -> None:
        self.checked: dict[str, int] = {}
        self.verified = True  # every bucket of the sync under way so far had checksums
        self.given: dict[str, int] = {}
        self.made: dict[str, int] | None = None

    def loaded(self, named: NamedTensorList) -> None:
        """A bucket of the sync under way was handed to the loader."""
        if any(n not in self.checked for n, _ in named):
            self.verified = False

    def unverified(self) -> None:
        """Weights were loaded without checksums (handed to the loader directly)."""
        self.verified = False

    def end_sync(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The sync is complete; ``params``: the generator's own parameters, by its names."""
        ok = self.verified and bool(self.checked)
        self.given = self.checked if ok else {}
        self.made = checksums_by_name(params) if ok else None
        self.checked, self.verified = {}, True

    def read_back(self, params: Iterable[tuple[str, torch.Tensor]], where: str = "generator") -> dict[str, int]:
        """Checksums by HF name of what the loader was given in the last sync.

        Args:
            params: the generator's parameters now, by the names ``end_sync`` saw.

        Raises:
            WeightSyncError: the last sync was not verified, or a parameter no longer holds
                what the loader made of it (named).
        """
        if self.made is None:
            raise WeightSyncError(f"weight read-back ({where}): the last sync ran without verify, and the read-back "
                                  f"reports a verified sync's tensors; sync with verify on "
                                  f"(policy.weight_sync.verify: true)")
        now = checksums_by_name(params)
        changed = sorted(n for n in self.made if now.get(n) != self.made[n])
        if changed:
            raise WeightSyncError(f"weight read-back ({where}): {len(changed)} parameter(s) changed since the last "
                                  f"sync loaded them: {', '.join(changed[:5])}")
        return dict(self.given)


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
