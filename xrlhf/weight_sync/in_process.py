"""``in_process``: trainer and generator in one process; tensors are handed over as they are.

A trainer and a generator hosted together in one process (an in-process ``LocalHandle``: tests,
notebooks) need no copy at all: the loader copies straight from the trainer's parameters into
its own. A run's generators are workers of their own and never use it.
"""

from __future__ import annotations

from typing import Any

import torch

from xrlhf.weight_sync.base import TRANSPORTS, Message, Transport


@TRANSPORTS.register("in_process")
class InProcessTransport(Transport):
    """Trainer and generator in one process: tensors are handed over as they are (no copy)."""

    name = "in_process"
    reach = "process"

    def pack(self, tensors: list[torch.Tensor], names: list[str], index: int) -> Any:
        return tensors

    def unpack(self, message: Message, device: torch.device | None = None) -> list[torch.Tensor]:
        return message.payload
