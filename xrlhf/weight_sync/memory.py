"""Host memory for weight sync: reused (pinned) bucket buffers and shared-memory files.

Why a module of its own: the ``cpu`` and ``disk`` transports stage buckets in host buffers
reused from one sync to the next (``HostBuffers``), and a receiver in another process on the
same host (vLLM's engine process) can map a buffer that lives in ``/dev/shm``
(``SharedFiles``, ``map_shared``) instead of receiving its bytes. Page-locking such memory
(``cudaHostRegister``) needs care that torch's own pinned allocator takes for its buffers: the
registration must be undone before the memory is unmapped.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import weakref
from typing import Any

import torch

from xrlhf.weight_sync.base import flat_layout, flatten

SHM_DIR = "/dev/shm"
_FILE_NUMBERS = itertools.count()


class SharedFiles:
    """Files in shared memory (``/dev/shm``) that another process on this host can map.

    Named ``xrlhf-<pid>-<n>``: ``close`` (or interpreter exit) deletes this process's, and a new
    pool deletes those of processes that no longer exist (a trainer killed with SIGKILL). Space
    is reserved when a file is made (``posix_fallocate``): a full or small ``/dev/shm`` (a
    container's default is 64 MB) raises ``OSError`` there, where touching pages of a mapping
    past the tmpfs limit would kill the process with SIGBUS later.
    """

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self.paths: set[str] = set()
        self._sweep()
        atexit.register(self.close)

    def _sweep(self) -> None:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            parts = name.split("-")
            if len(parts) == 3 and parts[0] == "xrlhf" and parts[1].isdigit() and not _alive(int(parts[1])):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except OSError:
                    pass

    def create(self, nbytes: int) -> str:
        """A new file of ``nbytes`` (space reserved); raises ``OSError`` if there is no room."""
        path = os.path.join(self.directory, f"xrlhf-{os.getpid()}-{next(_FILE_NUMBERS)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.paths.add(path)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            self.remove(path)
            raise
        os.close(fd)
        return path

    def remove(self, path: str) -> None:
        self.paths.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        for path in list(self.paths):
            self.remove(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _register(buf: torch.Tensor, registered: dict[int, int]) -> bool:
    """Page-lock ``buf`` (memory CUDA did not allocate); False where refused (a memlock limit):
    the buffer stays pageable, which is slower and still correct."""
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0) != 0:
        cudart.cudaGetLastError()  # clear it: CUDA's last error would surface in torch's next check
        return False
    registered[buf.data_ptr()] = buf.numel()
    return True


def _unregister(ptr: int, registered: dict[int, int]) -> None:
    if registered.pop(ptr, None) is not None:
        torch.cuda.synchronize()  # no copy into it may be in flight
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _unregister_all(registered: dict[int, int]) -> None:
    for ptr in list(registered):
        _unregister(ptr, registered)


def map_shared(path: str, nbytes: int) -> memoryview:
    """A read-only view of ``nbytes`` of a shared file (valid after the file is deleted)."""
    if not nbytes:
        return memoryview(b"")
    with open(path, "rb") as f:
        return memoryview(mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ))


class HostBuffers:
    """Host byte buffers reused from one sync to the next, one per bucket index.

    Pinned (page-locked) when the weights are on a GPU: a device-to-host copy into pageable
    memory goes through a driver bounce buffer at a fraction of the bus speed, and pinning a
    buffer costs far more than a copy, so each is pinned once and kept. Where ``/dev/shm`` has
    room, a buffer is a shared file (``SharedFiles``, pinned with ``cudaHostRegister``): a
    receiver in another process on this host maps it instead of being sent its bytes
    (``path``). Holds at most one model's size of host memory (what a sync's messages hold anyway).
    """

    def __init__(self, shared: SharedFiles | None = None) -> None:
        self.shared = shared
        self.buffers: list[torch.Tensor] = []
        self.pinned: list[bool] = []
        self.paths: list[str | None] = []
        # Memory page-locked with cudaHostRegister must be unregistered before it is unmapped:
        # CUDA keeps the registration, and a later mapping at the same address fails with
        # "resource already mapped" (seen on a GPU when a transport was dropped). ``close``
        # and ``_release`` unregister in order; the finalizer covers a HostBuffers that is just
        # dropped (it runs before the buffers it holds are freed).
        self.registered: dict[int, int] = {}
        weakref.finalize(self, _unregister_all, self.registered).atexit = False  # at exit all goes anyway

    def get(self, index: int, nbytes: int, pin: bool) -> torch.Tensor:
        """A ``[>= nbytes]`` uint8 CPU buffer for bucket ``index`` (a bucket's data is valid
        until the same bucket of the next sync is packed)."""
        while len(self.buffers) <= index:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
            self.pinned.append(False)
            self.paths.append(None)
        if self.buffers[index].numel() < nbytes or self.pinned[index] != pin:
            self._release(index)
            self.buffers[index], self.pinned[index], self.paths[index] = self._allocate(nbytes, pin)
        return self.buffers[index]

    def path(self, index: int) -> str | None:
        """The shared file behind buffer ``index``, or ``None`` for plain host memory."""
        return self.paths[index] if index < len(self.paths) else None

    def _allocate(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, bool, str | None]:
        if self.shared is not None:
            try:
                path = self.shared.create(nbytes)
            except OSError:
                path = None
            if path is not None:
                buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                if pin and nbytes:
                    pin = _register(buf, self.registered)
                return buf, pin, path
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin), pin, None

    def _release(self, index: int) -> None:
        buf, path = self.buffers[index], self.paths[index]
        _unregister(buf.data_ptr(), self.registered)
        if path is not None:
            self.shared.remove(path)

    def close(self) -> None:
        """Unregister page-locked buffers, delete the shared files; the buffers go with the last
        reference to them (a message may still hold one)."""
        _unregister_all(self.registered)
        if self.shared is not None:
            self.shared.close()
        self.buffers, self.pinned, self.paths = [], [], []

    def stage(self, index: int, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """``flatten`` into host buffer ``index``: ``(buffer [nbytes] uint8 on CPU, layout)``."""
        pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors)
        buf = self.get(index, flat_layout(tensors)["nbytes"], pin)
        return flatten(tensors, buf, pinned=self.pinned[index])
