"""``sm_carveout`` (``HFModelOptions``): validated, applied only on a GPU, and on a GPU it sets
torch's cuBLASLt path and carveout (control flow here; tests/gpu/test_sm_carveout_gpu.py runs it)."""

from __future__ import annotations

import types

import pytest
import torch

from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFInferEngine
from xrlhf.engines.hf import model as hf_model
from xrlhf.engines.hf.train import HFTrainOptions


def test_the_option_is_checked():
    assert HFTrainOptions().sm_carveout is None  # unset: the coordinator decides (coordinator.mps.carve_for_overlap)
    assert HFTrainOptions(sm_carveout=0.25).sm_carveout == 0.25
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        HFTrainOptions(sm_carveout=-0.1)
    with pytest.raises(ValueError, match="less than or equal to 0.9"):
        HFTrainOptions(sm_carveout=0.95)


@pytest.fixture
def calls(monkeypatch):
    seen: list = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda b: seen.append(("blas", b)))
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", lambda n: seen.append(("carveout", n)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    return seen


def test_carving_out_sets_cublaslt_and_the_carveout(calls):
    assert hf_model.carve_out_sms(0.5, torch.device("cuda")) == 66
    assert calls == [("blas", "cublaslt"), ("carveout", 66)]
    assert hf_model.carve_out_sms(0.001, torch.device("cuda")) == 0  # rounds to no SM: nothing set
    with pytest.raises(ValueError, match="0.999 of 132 SMs leaves none"):
        hf_model.carve_out_sms(0.999, torch.device("cuda"))
    assert len(calls) == 2


def test_a_cpu_engine_ignores_it(calls, tiny_model):
    HFInferEngine(EngineSpec(tiny_model, options={"micro_batch_size": 2, "sm_carveout": 0.5}))
    assert calls == []


def test_switched_off_it_sets_nothing_and_says_so(calls, monkeypatch):
    """The hook ``torch.sm_carveout`` off (public-only): no private call, no SM carved out."""
    monkeypatch.setenv("XRLHF_HOOKS_OFF", "torch.sm_carveout")
    assert hf_model.carve_out_sms(0.5, torch.device("cuda")) == 0
    assert calls == []


def test_the_recompile_limit_is_raised_only_with_its_hook_on(monkeypatch):
    import torch._dynamo

    from xrlhf.internals.torch import allow_recompiles

    # saved and set back by hand: monkeypatch would undo with delattr, which hides a setting of
    # torch's config module for the rest of the process
    saved = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8
        monkeypatch.setenv("XRLHF_PUBLIC_ONLY", "1")
        allow_recompiles(64)
        assert torch._dynamo.config.recompile_limit == 8
        monkeypatch.delenv("XRLHF_PUBLIC_ONLY")
        allow_recompiles(64)
        assert torch._dynamo.config.recompile_limit == 64
    finally:
        torch._dynamo.config.recompile_limit = saved
