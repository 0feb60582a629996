"""The vLLM worker extension: what xrlhf runs inside vLLM's worker processes.

vLLM mixes ``worker_extension_cls`` into its ``Worker`` class (``Worker.__bases__ +=``), so
these methods run where the model lives and ``LLM.collective_rpc("xrlhf_...")`` calls them on
every worker (one per tensor-parallel rank). This is the pattern of vLLM's own
``examples/offline_inference/rlhf*.py`` and of OpenRLHF.

Rules the mix-in imposes (``vllm/v1/worker/worker_base.py``): no ``__init__`` (it is never
called; state is created lazily), and no name that ``Worker`` already has (``update_weights``,
``sleep``, ``load_model`` ... exist there), hence the ``xrlhf_`` prefix. Arguments cross a
process boundary encoded with msgpack when vLLM runs its engine in a child process, which
does not rebuild tensors or arbitrary objects: the sync arrives pickled (``to_payload``) and
results go back as plain numbers, strings and lists.

Large buffers do not ride in the RPC. Pickled into one ``bytes``, a 256 MB bucket of the
``cpu`` transport was copied by pickle, by vLLM's msgpack encoder, by ZeroMQ on both sides and
by unpickling (docs/benchmarks.md has the figures). ``to_payload`` pickles
with protocol 5 and writes every buffer of 1 MiB or more to a file in ``/dev/shm`` (one copy
into shared memory); the RPC carries the pickle's metadata and the file names, and
``from_payload`` maps the files read-only, so the loader reads the sender's bytes in place. The
files are reused from one sync to the next (``ShmPool``). Where ``/dev/shm`` is missing or full,
the buffers go in band as before. The ``cpu`` transport goes one step further: its host buffers
already are shared files, so its messages reach here naming them (``Transport.local``) and
nothing is copied between the processes at all.

This module must import in vLLM's engine process without Ray: it imports only torch and
``xrlhf.weight_sync``.
"""

from __future__ import annotations

import mmap
import pickle
from typing import Any

import torch

from xrlhf.weight_sync import LoadRecord, Transport, WeightSyncError
from xrlhf.weight_sync.memory import SHM_DIR, SharedFiles, map_shared


SHM_MIN_BYTES = 1 << 20
"""Buffers of at least this size go through shared memory instead of the RPC."""

LORA_ID = 1
"""The id of the one LoRA adapter a policy syncs (``sync: adapter``): every sync replaces it in
place, so requests running across a sync go on with the new adapter, as with full weights."""
LORA_NAME = "xrlhf-policy"


class ShmPool:
    """Shared-memory files for ``to_payload``, one per buffer index, kept from one sync to the
    next: writing into a fresh tmpfs file pays for allocating every page (slow: docs/vllm.md),
    rewriting the same file costs a plain memcpy. The files are
    ``weight_sync.SharedFiles`` (space reserved when made; deleted on close, at exit, or by the
    next pool if this process was killed)."""

    def __init__(self, directory: str = SHM_DIR):
        self.files = SharedFiles(directory)
        self.slots: list[tuple[str, int]] = []

    def write(self, index: int, data: memoryview) -> str:
        """Put ``data`` in file ``index`` of the pool (made anew when the size changes); returns its path."""
        while len(self.slots) <= index:
            self.slots.append(("", -1))
        path, size = self.slots[index]
        if size != data.nbytes:
            if path:
                self.files.remove(path)
            path = self.files.create(data.nbytes)
            self.slots[index] = (path, data.nbytes)
        if data.nbytes:
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), data.nbytes) as mm:
                mm[:] = data.cast("B")
        return path

    def close(self) -> None:
        self.files.close()
        self.slots = []


def to_payload(obj: Any, pool: ShmPool | None) -> tuple[bytes, list[tuple[str, int]]]:
    """``obj`` pickled for another process on this host: ``(pickle, [(shared-memory file, bytes)])``.

    Buffers of ``SHM_MIN_BYTES`` or more go to ``pool``'s files (valid until the pool's next
    ``to_payload``); without a pool, or when shared memory fails (missing, full), in band.
    """
    big: list[pickle.PickleBuffer] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        if pool is None or buf.raw().nbytes < SHM_MIN_BYTES:
            return True  # in band
        big.append(buf)
        return False

    meta = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    try:
        return meta, [(pool.write(i, buf.raw()), buf.raw().nbytes) for i, buf in enumerate(big)]
    except OSError:  # no /dev/shm, or it is full: everything in band
        return pickle.dumps(obj, protocol=5), []


def from_payload(payload: Any) -> Any:
    """The object of ``to_payload``'s payload (a pickled ``bytes`` alone is accepted too)."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return pickle.loads(payload)
    meta, files = payload
    return pickle.loads(meta, buffers=[map_shared(path, nbytes) for path, nbytes in files])


class XrlhfWorkerExtension:
    """Mixed into vLLM's GPU ``Worker``: receive weights, load them, read them back."""

    def _xrlhf_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # unwraps the CUDA-graph wrapper of the V1 runner

    def _xrlhf_state(self) -> dict[str, Any]:
        state = getattr(self, "_xrlhf", None)
        if state is None:
            state = self._xrlhf = {"transports": {}, "loaded": set(), "record": LoadRecord()}
        return state

    def _xrlhf_tp_rank(self) -> int:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank_in_group

    def _xrlhf_kept(self, transport: Transport) -> Transport:
        """The transport object of ``transport``'s group kept here (a broadcast's connection
        lives from one sync to the next), or ``transport`` itself."""
        if transport.kind != "broadcast":
            return transport
        key = repr(sorted(transport.__getstate__().items()))
        return self._xrlhf_state()["transports"].setdefault(key, transport)

    def xrlhf_connect(self, payload: Any) -> None:
        """Open a broadcast transport's group now (``Transport.connect``), kept for ``xrlhf_receive``."""
        transport = payload if isinstance(payload, Transport) else from_payload(payload)
        self._xrlhf_kept(transport).connect(self.device, rank_offset=self._xrlhf_tp_rank())

    def xrlhf_receive(self, payload: bytes | memoryview | tuple) -> int:
        """Receive weights through a transport and load them; returns the number of tensors.

        Args:
            payload: ``to_payload((transport, messages))``, or the tuple itself when the
                engine runs in the caller's process. ``messages`` is a list of
                ``weight_sync.Message`` (message transports) or ``None`` (broadcast: the
                buckets come from the transport's own group, whose connection is kept here
                from one sync to the next).
        """
        if isinstance(payload, (tuple, list)) and isinstance(payload[0], Transport):  # same process
            transport, messages = payload
        else:
            transport, messages = from_payload(payload)
        transport = self._xrlhf_kept(transport)
        record = self._xrlhf_state()["record"]
        n = 0
        for named in transport.receive_all(messages, self.device, rank_offset=self._xrlhf_tp_rank(),
                                           checked=record.checked):
            self._xrlhf_load(named)
            record.loaded(named)
            n += len(named)
            del named
        if self.device.type == "cuda":  # copies done before the sender reuses or frees its memory
            torch.cuda.synchronize(self.device)
        return n

    def xrlhf_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load ``(HF name, tensor)`` pairs given directly (engine in the caller's process)."""
        self._xrlhf_state()["record"].unverified()
        self._xrlhf_load(named)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(named)

    def _xrlhf_load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Weights into the model; in adapter mode, adapter tensors kept (copied: a transport may
        reuse its memory) until ``xrlhf_end_sync`` installs them."""
        state = self._xrlhf_state()
        adapter = state.get("adapter")
        if adapter is not None:
            adapter["tensors"].update((n, t.detach().to("cpu", copy=True)) for n, t in named)
            return
        model = self._xrlhf_model()
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            # the output embedding is the input one in vLLM: loaded with it (vLLM 0.33 refuses a bucket
            # that holds the tied name without the one it is tied to)
            named = [(n, t) for n, t in named if not n.endswith("lm_head.weight")]
        state["loaded"].update(model.load_weights(weights=named) or ())

    def xrlhf_end_sync(self) -> list[str]:
        """Parameters not loaded since the last call (a complete sync loads every one). In adapter
        mode the sync's adapter is installed first, and only an adapter tensor can be missing."""
        state = self._xrlhf_state()
        adapter = state.get("adapter")
        if adapter is not None:
            tensors, adapter["tensors"] = adapter["tensors"], {}
            if tensors:
                self._xrlhf_install_adapter(tensors, adapter["config"])
            state["record"].end_sync(self._xrlhf_model().named_parameters())
            return []
        state["record"].end_sync(self._xrlhf_model().named_parameters())
        names = {n for n, _ in self._xrlhf_model().named_parameters()}
        missing = sorted(names - state["loaded"])
        state["loaded"] = set()
        return missing

    def xrlhf_weight_checksums(self) -> dict[str, int]:
        """Read-back: ``checksum`` by HF name of each tensor the loader was given in the last sync.

        vLLM's loader converts what it is given (GPT-2's Conv1D weights transposed, q/k/v and
        gate/up stacked, the vocabulary padded, tensor-parallel slices), so its parameters do
        not compare with the trainer's tensors by name. The record (``weight_sync.LoadRecord``)
        compares like with like: the tensors as received, by HF name, after checking that every
        parameter still holds what the loader made of them at the end of that sync. Needs the
        last sync to have run with verify on.
        """
        return self._xrlhf_state()["record"].read_back(self._xrlhf_model().named_parameters(), "vLLM")

    # -- logprobs kept on the GPU (``policy.generate.logprobs_path: worker``, ``internals/vllm_record.py``) -----------
    def xrlhf_record_logprobs(self, on: bool = True) -> bool:
        """From now on this worker's sampler records each sampled token's logprob (``internals.vllm_record.install``),
        or, ``on`` false, no longer does (``internals.vllm_record.uninstall``: what it held untaken is dropped).
        Returns whether it records now."""
        from xrlhf.internals.vllm_record import install, uninstall

        if not on:
            uninstall(self.model_runner)
            return False
        install(self.model_runner, self.device)
        return True

    def xrlhf_take_logprobs(self, keys: list[str], lengths: list[int], drop: list[str]) -> bytes:
        """The recorded logprobs of finished requests ``keys`` (the ids the caller gave), the first
        ``lengths[i]`` of each, concatenated as float32 bytes; ``drop``: requests never to be taken."""
        record = self.model_runner.sampler._xrlhf_record
        record.forget(list(drop))
        return record.take(list(keys), list(lengths)).numpy().tobytes()

    # -- LoRA adapters (``policy.train.lora.sync: adapter``) --------------------------------------
    def xrlhf_set_adapter(self, config: dict[str, Any], directory: str) -> None:
        """Adapter mode: from now on a sync carries the policy's LoRA adapter (PEFT's tensor
        names; ``config``: its ``adapter_config.json``) instead of the model's weights; this
        worker writes it under ``directory`` (``tp<rank>``) for vLLM's adapter loader."""
        path = f"{directory}/tp{self._xrlhf_tp_rank()}"
        self._xrlhf_state()["adapter"] = {"config": dict(config), "tensors": {}, "dir": path, "installed": False}

    def _xrlhf_install_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Write ``tensors`` as a PEFT adapter directory (in /dev/shm: memory) and load it as
        vLLM's adapter ``LORA_ID`` in place of the previous one, through the worker's own
        ``add_lora`` (vLLM loads adapters from files only; no private loader is patched)."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        adapter = self._xrlhf_state()["adapter"]
        out = Path(adapter["dir"])
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(config))
        adapter["installed"] = True
        self.xrlhf_reload_adapter()

    def xrlhf_reload_adapter(self) -> bool:
        """(Re)load the last adapter written (after a sync, and after a wake: vLLM may lose an
        adapter's GPU copy across sleep, vllm#53888); ``False`` when there is none yet.

        Raises:
            WeightSyncError: vLLM runs without LoRA, or the adapter has a layer vLLM has no LoRA
                slot for (it would be ignored silently, generating with the base there).
        """
        from vllm.lora.request import LoRARequest

        adapter = self._xrlhf_state().get("adapter")
        if adapter is None or not adapter["installed"]:
            return False
        if getattr(self.model_runner, "lora_manager", None) is None:
            raise WeightSyncError("weight sync: an adapter arrived, but vLLM runs without LoRA (enable_lora)")
        self.add_lora(LoRARequest(LORA_NAME, LORA_ID, adapter["dir"], load_inplace=True))
        unused = self._xrlhf_unused_lora_layers()
        if unused:
            raise WeightSyncError(f"weight sync: vLLM has no LoRA layer for {len(unused)} adapted layer(s) of the "
                                  f"adapter: {', '.join(unused[:5])}; use policy.train.lora.sync: merged")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return True

    def _xrlhf_unused_lora_layers(self) -> list[str]:
        """Layers of the loaded adapter that match no LoRA layer of vLLM's model (a check only:
        ``internals.vllm.unused_lora_layers``)."""
        from xrlhf.internals.vllm import unused_lora_layers

        return unused_lora_layers(self.model_runner, LORA_ID)
