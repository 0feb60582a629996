"""NVIDIA MPS in the user's environment: a warning where it limits the SMs of each client.

xrlhf starts no MPS daemon of its own: one step off on one GPU, a daemon made the trainer's phase
faster beside generation but not the step, which generation bounds there (docs/internals.md, "One
step off, hook by hook"). A user may still run Ray's processes as clients of a daemon of their own
(``CUDA_MPS_PIPE_DIRECTORY`` in the environment); what that environment must not hold is below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SM_LIMIT = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def sm_limit_warning(environ: Mapping[str, str] = os.environ) -> str | None:
    """A warning where the environment limits an MPS client's SMs (every Ray worker inherits it).

    Why: cuBLAS's bf16 GEMMs were measured wrong (finite garbage or NaN, no error) under most SM
    limits, and a model's loss can look right while some shapes are wrong, so nothing at run time
    can vouch for a limit (the limits and shapes: docs/async.md, docs/design/probes.md)."""
    value = environ.get(SM_LIMIT, "").strip()
    if not value:
        return None
    try:
        if float(value) >= 100:
            return None
    except ValueError:
        pass
    return (f"{SM_LIMIT}={value} limits every MPS client's SMs, and cuBLAS GEMMs were measured wrong (NaN or "
            "garbage, no error) under most limits on an H100 (docs/async.md); unset it unless a check like "
            "the SM-limit probe of docs/design/probes.md passes on this GPU")
