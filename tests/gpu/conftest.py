"""GPU test fixtures: models built locally (see ``gpu_helpers`` for ``XRLHF_VLLM``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.gpu_helpers import ROOT


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    """4.2M parameters, char tokenizer, float32: small enough that float32 greedy decoding is
    the same in vLLM and Transformers."""
    from xrlhf.models.tiny import PRESETS, build_model

    return str(build_model(tmp_path_factory.mktemp("models") / "small", **PRESETS["small"], seed=0))


@pytest.fixture(scope="session")
def model_05b() -> str:
    """The 0.5B model of the GPU configs (``XRLHF_MODEL_05B`` or artifacts/model-0.5b; built if missing)."""
    from xrlhf.models.tiny import PRESETS, build_model

    path = Path(os.environ.get("XRLHF_MODEL_05B", ROOT / "artifacts" / "model-0.5b"))
    if not (path / "config.json").is_file():
        build_model(path, **PRESETS["0.5b"], dtype="bfloat16")
    return str(path.resolve())


@pytest.fixture(scope="session", autouse=True)
def ray_session():
    """No shared Ray for the GPU tests: each run starts its own from its config (GPUs, CPUs)."""
    yield
