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
``xrlhf.engines.weight_sync``.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from xrlhf.engines.weight_sync import checksum


class XrlhfWorkerExtension:
    """Mixed into vLLM's GPU ``Worker``: receive weights, load them, read them back."""

    def _xrlhf_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # unwraps the CUDA-graph wrapper of the V1 runner

    def _xrlhf_state(self) -> dict[str, Any]:
        state = getattr(self, "_xrlhf", None)
        if state is None:
            state = self._xrlhf = {"transports": {}, "loaded": set()}
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
        n = 0
        for named in transport.receive_all(messages, self.device, rank_offset=self._xrlhf_tp_rank()):
            loaded = model.load_weights(weights=named)
            state["loaded"].update(loaded or ())
            n += len(named)
            del named, loaded
        if self.device.type == "cuda":  # copies done before the sender reuses or frees its memory
            torch.cuda.synchronize(self.device)
        return n

    def xrlhf_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load ``(HF name, tensor)`` pairs given directly (engine in the caller's process)."""
        self._xrlhf_state()["loaded"].update(self._xrlhf_model().load_weights(weights=named) or ())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(named)

    def xrlhf_end_sync(self) -> list[str]:
        """Parameters not loaded since the last call (a complete sync loads every one)."""
        state = self._xrlhf_state()
        names = {n for n, _ in self._xrlhf_model().named_parameters()}
        missing = sorted(names - state["loaded"])
        state["loaded"] = set()
        return missing

    def xrlhf_weight_checksums(self) -> dict[str, int]:
        """``checksum`` of every weight by HF name, fused tensors split back into their parts.

        vLLM fuses ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` and ``gate_proj``/
        ``up_proj`` into ``gate_up_proj`` (rows stacked in that order); their rows are split by
        the layer's ``output_partition_sizes`` so each part compares with the trainer's own
        tensor. A padded vocabulary is cut back to ``num_embeddings``. Tensor-parallel size 1
        only (with more, each worker holds slices of every tensor).
        """
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() != 1:
            raise NotImplementedError("weight read-back needs tensor_parallel_size 1")
        model = self._xrlhf_model()
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        modules = dict(model.named_modules(remove_duplicate=False))
        out: dict[str, int] = {}
        with torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=False):
                prefix, _, leaf = name.rpartition(".")
                module = modules.get(prefix)
                parent, _, last = prefix.rpartition(".")
                sizes = getattr(module, "output_partition_sizes", None)
                if last in packed and sizes is not None and len(sizes) == len(packed[last]):
                    for part, piece in zip(packed[last], p.split(list(sizes), dim=0)):
                        out[f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}"] = checksum(piece)
                    continue
                rows = getattr(module, "num_embeddings", None)
                out[name] = checksum(p[:rows] if isinstance(rows, int) and p.shape[0] > rows else p)
        return out

    def xrlhf_gpu_uuid(self) -> str:
        """The UUID of this worker's GPU."""
        return str(torch.cuda.get_device_properties(self.device).uuid)

