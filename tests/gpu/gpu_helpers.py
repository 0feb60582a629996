"""Helpers of the GPU tests: the vLLM settings of this machine, free ports.

``XRLHF_VLLM``: optional JSON of ``policy.generate`` fields applied to every vLLM engine the
GPU tests (and benchmarks) build, e.g. ``'{"enforce_eager": true}'`` or
``'{"engine_options": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}}'``, for a
machine where vLLM's defaults do not start (docs/vllm.md, the start-up hang).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def vllm_overrides() -> dict:
    return json.loads(os.environ.get("XRLHF_VLLM") or "{}")


def generate_options(**fields) -> dict:
    """``EngineSpec.options`` of a vLLM generate section: ``fields`` + ``XRLHF_VLLM``."""
    from xrlhf.engines.vllm import VLLMOptions  # light: vLLM is imported only to build an engine

    over = vllm_overrides()
    engine_options = {**fields.pop("engine_options", {}), **over.pop("engine_options", {})}
    return VLLMOptions(engine="vllm", **{**fields, **over}, engine_options=engine_options).model_dump()


def cli_overrides() -> list[str]:
    """``XRLHF_VLLM`` as ``policy.generate.<field>=<value>`` overrides of a YAML config."""
    return [f"policy.generate.{k}={json.dumps(v)}" for k, v in vllm_overrides().items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vowel_share(prompts: list[str], responses: list[str]) -> list[float]:
    """A dense reward (``reward.function``) for a model that answers nothing yet: the share of
    vowels among a response's letters. Random text earns a different score per sample, so a
    GRPO group has non-zero advantages and a step has a gradient to compare."""
    out = []
    for r in responses:
        letters = [c for c in r.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return out
