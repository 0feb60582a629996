"""coordinator/mps.py: xrlhf starts no MPS daemon; an SM limit in the environment that Ray's
workers inherit is warned about."""

from __future__ import annotations

from xrlhf.coordinator import mps


def test_an_sm_limit_in_the_environment_is_warned_about():
    """cuBLAS GEMMs were measured wrong under most MPS SM limits (docs/async.md): a limit below 100%
    in the environment, which every Ray worker inherits, is named with the fix; none, 100%, nothing."""
    assert mps.sm_limit_warning({}) is None
    assert mps.sm_limit_warning({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}) is None
    warning = mps.sm_limit_warning({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"})
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75" in warning and "unset it" in warning
