"""Throughput and model FLOPs utilisation (MFU) of a step, from the model's shape and the step's
sequence lengths.

MFU here is the usual one (PaLM, appendix B): the FLOPs the model needs for the tokens trained,
whatever recomputation or padding the engine adds, over the time taken and the GPUs' dense bf16
peak. Per token, a forward and backward pass costs 6 FLOPs per weight of a matrix multiply (the
input embedding is a lookup and counts nothing; a tied output head counts once), and causal
attention adds ``6 * layers * width * length`` over the sequence (the QK^T and AV products,
half the square each).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("GH200", 989.4),
                    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1))
"""Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's datasheets, by a substring
of the device name; the first match wins (so ``H100 PCIe`` before ``H100``: the SXM part)."""


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a GPU called ``device_name``; ``None`` when unknown."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


@dataclass(frozen=True)
class MatmulShape:
    """What the FLOPs count reads of a decoder: weights of its matrix multiplies, layers, width.

    Attributes:
        matmul_params: weights of every matrix multiply per token (attention, MLP, output head).
        layers, width: decoder layers, attention width (heads x head size).
    """

    matmul_params: int
    layers: int
    width: int

    @classmethod
    def of_config(cls, config: dict) -> "MatmulShape":
        """From a Llama-style ``config.json`` (``text_config`` where it nests one)."""
        c = config.get("text_config") or config
        hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        kv = int(c.get("num_key_value_heads") or heads) * head_dim
        mlp = int(c.get("intermediate_size") or 4 * hidden)
        attention = hidden * heads * head_dim * 2 + hidden * kv * 2  # q, o; k, v
        per_layer = attention + 3 * hidden * mlp  # gate, up, down
        return cls(layers * per_layer + int(c["vocab_size"]) * hidden, layers, heads * head_dim)

    @classmethod
    def of_model(cls, model_dir: str | Path) -> "MatmulShape":
        """From the ``config.json`` in ``model_dir``."""
        return cls.of_config(json.loads((Path(model_dir) / "config.json").read_text()))


def train_flops(shape: MatmulShape, tokens: float, squared_lengths: float) -> float:
    """FLOPs of one forward and backward pass over sequences of ``tokens`` tokens in all, whose
    lengths squared sum to ``squared_lengths`` (module docstring)."""
    return 6.0 * shape.matmul_params * tokens + 6.0 * shape.layers * shape.width * squared_lengths


def mfu(flops: float, seconds: float, peak: float, gpus: int) -> float:
    """``flops`` done in ``seconds`` on ``gpus`` GPUs of ``peak`` FLOP/s each, as a share of their peak."""
    return flops / (seconds * peak * gpus) if seconds > 0 and gpus > 0 else 0.0


class StepThroughput:
    """A step's tokens per second per GPU and its train phase's MFU, from the workers' memory
    stats (which GPU each rank is on: ``EngineHost.memory_stats``) and the step's metrics.

    Args:
        shape: the policy's ``MatmulShape``; ``None``: no MFU (a model it cannot read).
        epochs: passes over the batch in the train phase (``algorithm.ppo_epochs``).
    """

    def __init__(self, shape: MatmulShape | None, epochs: int = 1):
        self.shape, self.epochs = shape, epochs
        self.gpus: set[str] = set()
        self.train_gpus: set[str] = set()
        self.names: set[str] = set()

    def see(self, stats: dict[str, list[dict]]) -> None:
        """Note the GPUs of ``{handle: [per-rank memory stats]}`` (the policy's train the model)."""
        for handle, ranks in stats.items():
            for r in ranks:
                if "gpu" in r:
                    self.gpus.add(r["gpu"])
                    self.names.add(r.get("gpu_name", ""))
                    if handle == "policy":
                        self.train_gpus.add(r["gpu"])

    def metrics(self, m: dict[str, float]) -> dict[str, float]:
        """``perf/tokens_per_s_per_gpu`` (prompt and response tokens of the step's sequences over
        the step's time and every GPU of the run) and ``perf/train_mfu`` (the policy's train
        phase; only where every GPU is of one known kind); empty off a GPU."""
        tokens, seconds = m.get("perf/sequence_tokens"), m.get("time/step_s")
        if not self.gpus or not tokens or not seconds:
            return {}
        out = {"perf/tokens_per_s_per_gpu": tokens / seconds / len(self.gpus)}
        peak = peak_flops(next(iter(self.names))) if len(self.names) == 1 else None
        if self.shape is not None and peak and m.get("time/train_s") and self.train_gpus:
            flops = train_flops(self.shape, tokens * self.epochs, m.get("perf/sequence_tokens_sq", 0.0) * self.epochs)
            out["perf/train_mfu"] = mfu(flops, m["time/train_s"], peak, len(self.train_gpus))
        return out
