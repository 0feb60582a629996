"""``disk``: each bucket a safetensors file in a directory that trainer and generators share.

The simplest of the field's weight-update methods (slime's ``update_weight_from_disk``): it
needs no NCCL connectivity between the trainer's and the generators' clusters, only a file
system both see (a node's local disk when they share a node, NFS/Lustre across nodes). The
message carries the file's path; the data never goes through the coordinator.

Sender. Each bucket is written as ``<directory>/<sender>-<sync>-<bucket>.safetensors``: GPU
tensors are first copied into one pinned host buffer per bucket (as the ``cpu`` transport
does), then written tensor by tensor from it. The file is written under a temporary name and
renamed when complete (``os.replace`` is atomic within a directory), so a receiver sees a whole
file or none. No ``fsync``: a crash loses the sync either way, and readers on the same node
read the page cache. The files are plain safetensors (``safetensors.safe_open`` reads them);
they are written here rather than by ``safetensors.torch.save_file`` because that refuses
tensors that share memory (tied embeddings, views of one host buffer) and copies each tensor
into ``bytes`` first.

Receiver. The file is memory-mapped (``torch.UntypedStorage.from_file``, private mapping) and
each tensor is a view into the mapping, so the loader's copy is the only one; a tensor whose
offset does not suit its dtype (safetensors packs tensors without padding) is copied.

Clean-up. Receivers may read a sync's files at any time until the sync is over, and the sender
does not know when every receiver is done, so the sender deletes a sync's files at the start
of its next sync, and its last ones when it goes away (a directory it made itself goes too).
At most one sync's files are on disk at a time; a process killed outright leaves its last
sync's files behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import weakref
from typing import Any, Iterable, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field

from xrlhf.weight_sync.base import TRANSPORTS, Message, Transport, WeightSyncError, unflatten
from xrlhf.weight_sync.memory import HostBuffers

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
"""torch dtype -> the safetensors header's dtype name."""

_TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def write_safetensors(path: str, names: list[str], tensors: list[torch.Tensor]) -> None:
    """Write CPU ``tensors`` as a safetensors file at ``path``, atomically (temporary name, then rename)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in zip(names, tensors):
        if t.dtype not in SAFETENSORS_DTYPES:
            raise WeightSyncError(f"weight sync (disk): tensor {name!r} has dtype {t.dtype}, which safetensors "
                                  f"cannot store; use transport cpu")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t in tensors:
            if t.numel():
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    os.replace(tmp, path)


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, as views of a private memory map of it (in file order)."""
    size = os.path.getsize(path)
    data = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(path, shared=False, nbytes=size))
    n = int.from_bytes(data[:8].numpy().tobytes(), "little")
    header = json.loads(data[8:8 + n].numpy().tobytes())
    header.pop("__metadata__", None)
    start = 8 + n
    out = {}
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = _TORCH_DTYPES[entry["dtype"]]
        begin, end = (start + o for o in entry["data_offsets"])
        raw = data[begin:end]
        if begin % torch.empty((), dtype=dtype).element_size():
            raw = raw.clone()  # a misaligned offset cannot be viewed as a wider dtype
        out[name] = raw.view(dtype).view(entry["shape"])
    return out


def _remove(files: list[str], directory: str | None) -> None:
    """Delete ``files`` (and ``directory``, when the transport made it); missing ones are fine."""
    for f in files:
        try:
            os.remove(f)
        except FileNotFoundError:
            pass
    files.clear()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class DiskOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    directory: str | None = Field(None, description="where the trainer writes and the generators read (default: "
                                  "a new directory under the trainer's TMPDIR, one node only)")


@TRANSPORTS.register("disk")
class DiskTransport(Transport):
    """Any placement with a shared file system: a safetensors file per bucket, its path per message.

    Args:
        directory: where the sender writes; every receiver must see it under the same path.
            Default: a new directory under the sender's temporary directory (``TMPDIR``),
            which serves trainer and generators on one node, removed with the sender.
    """

    name = "disk"
    Options = DiskOptions

    def __init__(self, bucket_bytes: int = 256 << 20, verify: bool = False, dtype: torch.dtype | None = None,
                 directory: str | None = None):
        super().__init__(bucket_bytes, verify, dtype)
        self.directory = directory

    def _open(self) -> None:
        """Sender side, once: the directory, this sender's file-name prefix, the clean-up at exit."""
        own = self.directory is None
        try:
            path = tempfile.mkdtemp(prefix="xrlhf-weights-") if own else self.directory
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise WeightSyncError(f"weight sync (disk): cannot create {self.directory!r} ({e}); set "
                                  f"policy.weight_sync.directory to a directory every worker can write") from None
        self._dir, self._files, self._host = path, [], HostBuffers()
        self._prefix = f"xrlhf-{uuid.uuid4().hex[:12]}"  # senders may share a directory
        self._syncs = 0
        self._cleanup = weakref.finalize(self, _remove, self._files, path if own else None)

    def close(self) -> None:
        """Delete the last sync's files (and the directory this sender made) now."""
        cleanup = getattr(self, "_cleanup", None)
        if cleanup is not None:
            cleanup()

    @property
    def files(self) -> list[str]:
        """Sender side: the files of the last sync (deleted when the next one starts)."""
        return list(getattr(self, "_files", []))

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Message]:
        if getattr(self, "_files", None) is None:
            self._open()
        _remove(self._files, None)  # every receiver has read the last sync's files: it is over
        self._syncs += 1
        yield from super().send(weights)

    def pack(self, tensors: list[torch.Tensor], names: list[str], index: int) -> Any:
        path = os.path.join(self._dir, f"{self._prefix}-{self._syncs:06d}-{index:05d}.safetensors")
        if any(t.device.type != "cpu" for t in tensors):
            buf, layout = self._host.stage(index, tensors)  # one pinned copy at bus speed, then write from it
            tensors = unflatten(buf, layout)
        self._files.append(path)
        try:
            write_safetensors(path, names, tensors)
        except OSError as e:
            raise WeightSyncError(f"weight sync (disk): cannot write {path} ({e}); set policy.weight_sync.directory "
                                  f"to a directory with room for one copy of the weights") from None
        return path

    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        try:
            tensors = read_safetensors(message.payload)
        except (OSError, RuntimeError) as e:
            raise WeightSyncError(f"weight sync (disk): cannot read {message.payload} ({e}); the generators must see "
                                  f"the trainer's policy.weight_sync.directory under the same path") from None
        missing = [n for n in message.names if n not in tensors]
        if missing:
            raise WeightSyncError(f"weight sync (disk): {message.payload} lacks {', '.join(map(repr, missing[:5]))}")
        return [tensors[n] for n in message.names]
