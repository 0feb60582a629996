"""The vLLM worker extension: what xrlhf runs inside vLLM's worker processes.

vLLM mixes ``worker_extension_cls`` into its ``Worker`` class (``Worker.__bases__ +=``), so
these methods run where the model lives and ``LLM.collective_rpc("xrlhf_...")`` calls them on
every worker (one per tensor-parallel rank). This is the pattern of vLLM's own
``examples/offline_inference/rlhf*.py`` and of OpenRLHF.

Rules the mix-in imposes (``vllm/v1/worker/worker_base.py``): no ``__init__`` (it is never
called; state is created lazily), and no name that ``Worker`` already has (``update_weights``,
``sleep``, ``load_model`` ... exist there), hence the ``xrlhf_`` prefix. Arguments cross a
process boundary encoded with msgpack when vLLM runs its engine in a child process, which
does not rebuild tensors or arbitrary objects: the sync arrives as pickled ``bytes`` and
results go back as plain numbers, strings and lists.

This module must import in vLLM's engine process without Ray: it imports only torch and
``xrlhf.weight_sync``.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from xrlhf.weight_sync import LoadRecord


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

    def xrlhf_receive(self, payload: bytes | memoryview | tuple) -> int:
        """Receive weights through a transport and load them; returns the number of tensors.

        Args:
            payload: ``pickle.dumps((transport, messages))``, or the tuple itself when the
                engine runs in the caller's process. ``messages`` is a list of
                ``weight_sync.Message`` (message transports) or ``None`` (broadcast: the
                buckets come from the transport's own group, whose connection is kept here
                from one sync to the next).
        """
        if isinstance(payload, (bytes, bytearray, memoryview)):
            transport, messages = pickle.loads(payload)
        else:
            transport, messages = payload
        state = self._xrlhf_state()
        if transport.kind == "broadcast":  # keep the connection: one transport object per group
            key = repr(sorted(transport.__getstate__().items()))
            transport = state["transports"].setdefault(key, transport)
        model = self._xrlhf_model()
        record = state["record"]
        n = 0
        for named in transport.receive_all(messages, self.device, rank_offset=self._xrlhf_tp_rank(),
                                           checked=record.checked):
            loaded = model.load_weights(weights=named)
            record.loaded(named)
            state["loaded"].update(loaded or ())
            n += len(named)
            del named, loaded
        if self.device.type == "cuda":  # copies done before the sender reuses or frees its memory
            torch.cuda.synchronize(self.device)
        return n

    def xrlhf_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load ``(HF name, tensor)`` pairs given directly (engine in the caller's process)."""
        self._xrlhf_state()["record"].unverified()
        self._xrlhf_state()["loaded"].update(self._xrlhf_model().load_weights(weights=named) or ())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(named)

    def xrlhf_end_sync(self) -> list[str]:
        """Parameters not loaded since the last call (a complete sync loads every one)."""
        state = self._xrlhf_state()
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
