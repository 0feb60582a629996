"""Weight sync: how a train engine's weights reach a generate engine (STYLE principle 7).

One module per transport (``in_process``, ``cpu``, ``cuda_ipc``, ``nccl``, ``disk``), each
registering itself in the lazy ``TRANSPORTS`` registry and imported only when its name is
asked for; ``base`` holds what they share (see its docstring), ``memory`` the host buffers
and shared-memory files. The package is a leaf: it
imports torch, safetensors and ``xrlhf.utils`` only, so engines (vLLM's worker included) and
the coordinator both import it without importing each other. Who sends to whom in a Ray run
is ``xrlhf.coordinator.weight_routes``.
"""

from xrlhf.weight_sync.base import (ALIGN, TRANSPORTS, LoadRecord, Message, NamedTensorList, Receiver, Transport,
                                    WeightSyncError, buckets, build_transport, check_options, checksum, checksums,
                                    checksums_by_name, choose_transport, compare_checksums, flat_layout, flatten,
                                    push_weights, transport_errors, unflatten)
from xrlhf.weight_sync.memory import HostBuffers, SharedFiles, map_shared

__all__ = ["ALIGN", "TRANSPORTS", "HostBuffers", "SharedFiles", "map_shared", "LoadRecord", "Message", "NamedTensorList", "Receiver", "Transport",
           "WeightSyncError", "buckets", "build_transport", "check_options", "checksum", "checksums", "checksums_by_name",
           "choose_transport", "compare_checksums", "flat_layout", "flatten", "push_weights", "transport_errors",
           "unflatten"]
