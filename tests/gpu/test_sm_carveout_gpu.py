"""``sm_carveout`` on a GPU: the GEMMs go through cuBLASLt with an SM count target and stay right
(an MPS SM limit made cuBLAS's GEMMs wrong: docs/async.md), on W's shapes.

Run: ``pytest -m gpu tests/gpu/test_sm_carveout_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from xrlhf.engines.hf.model import carve_out_sms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def carveout():
    yield
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("default")


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_gemms_with_sms_carved_out_match_fp32(carveout, share):
    sms = carve_out_sms(share, torch.device("cuda"))
    assert sms > 0 and torch._C._get_sm_carveout_experimental() == sms
    torch.manual_seed(0)
    for m, k, n in ((40037, 1024, 4864), (40037, 4864, 1024), (9216, 1024, 32000), (1024, 1024, 1024)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for a, b in ((x, w.t()), (x.t(), torch.randn(m, n, device="cuda", dtype=torch.bfloat16))):
            y, ref = (a @ b).float(), a.float() @ b.float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            assert torch.isfinite(y).all() and err < 0.02, (m, k, n, err)


def test_a_carveout_of_every_sm_is_refused(carveout):
    with pytest.raises(ValueError, match="leaves none"):
        carve_out_sms(0.9999, torch.device("cuda"))
