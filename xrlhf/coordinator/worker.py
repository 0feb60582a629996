"""``EngineWorker``: the Ray actor that hosts one rank of a model handle.

A worker holds the engines of its handle for one rank (the policy: a train and a generate
engine; the critic: a train engine; the reference and reward: an infer engine) and exposes
them as plain methods. It knows nothing about algorithms: losses arrive as picklable
callables built by the algorithm layer.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
import torch

from xrlhf.data.batch import Batch
from xrlhf.engines.base import (DistInfo, EngineSpec, GenerateEngine, GenerationOutput, InferEngine, LossFn,
                                SamplingParams, TrainEngine, build_engine)
from xrlhf.engines.weight_sync import Message, build_transport


class EngineWorker:
    """One rank of a handle. Created by ``ModelHandle`` as ``ray.remote(EngineWorker)``.

    Args:
        handle: the handle's name (for messages).
        rank: this worker's rank in the handle.
        threads: torch CPU threads for this worker.
    """

    def __init__(self, handle: str, rank: int, threads: int = 1):
        self.handle = handle
        self.rank = rank
        torch.set_num_threads(max(1, threads))
        self.train: TrainEngine | None = None
        self.infer_engine: InferEngine | None = None
        self.gen: GenerateEngine | None = None
        self.transport = None

    # -- set-up ---------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (rank 0 hosts the torch.distributed rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, engines: dict[str, tuple[str, EngineSpec]], dist: DistInfo) -> dict[str, Any]:
        """Build the engines: ``engines`` maps a role (train / infer / generate) to (name, spec)."""
        for role, (name, spec) in engines.items():
            spec.dist = dist
            if spec.device == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(f"{self.handle} rank {self.rank}: a GPU was asked for but CUDA is not available")
            engine = build_engine(name, spec, role)  # type: ignore[arg-type]
            setattr(self, {"train": "train", "infer": "infer_engine", "generate": "gen"}[role], engine)
        return {"pid": os.getpid(), "device": str(next(iter(engines.values()))[1].device)}

    def set_transport(self, name: str, bucket_bytes: int, verify: bool) -> None:
        self.transport = build_transport(name, bucket_bytes=bucket_bytes, verify=verify)

    def pid(self) -> int:
        return os.getpid()

    # -- compute --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        return self.gen.generate(prompts, params)

    def infer(self, batch: Batch) -> Batch:
        engine = self.infer_engine or self.train
        return engine.infer(batch)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        return self.train.train_step(batch, loss_fn)

    # -- weights --------------------------------------------------------------------------
    def sync_weights_local(self) -> int:
        """Train engine -> generate engine of this worker, through the configured transport."""
        n = 0
        for message in self.transport.send(self.train.named_weights()):
            self.gen.update_weights(self.transport.receive(message))
            n += len(message.names)
        return n

    def send_weights(self) -> list[Message]:
        """Sender side of a cross-worker transport: every bucket's message."""
        return list(self.transport.send(self.train.named_weights()))

    def receive_weights(self, messages: list[Message]) -> int:
        for message in messages:
            self.gen.update_weights(self.transport.receive(message))
        return sum(len(m.names) for m in messages)

    def save_pretrained(self, path: str) -> str:
        self.train.save_pretrained(path)
        return path

    def state_dict(self) -> dict[str, Any]:
        return self.train.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train.load_state_dict(state)

    def rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "gen_calls": getattr(self.gen, "_calls", None)}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if self.gen is not None and state.get("gen_calls") is not None:
            self.gen._calls = state["gen_calls"]

    # -- memory phases (co-located layouts) -------------------------------------------------
    def sleep_generator(self) -> None:
        if self.gen is not None:
            self.gen.sleep()

    def wake_generator(self) -> None:
        if self.gen is not None:
            self.gen.wake_up()

    def offload(self) -> None:
        for e in (self.train, self.infer_engine):
            if e is not None:
                e.offload()

    def reload(self) -> None:
        for e in (self.train, self.infer_engine):
            if e is not None:
                e.reload()
