"""This machine's GPUs as ``nvidia-smi`` lists them: no CUDA context in the driver (one would hold
~0.5 GiB of the GPU for the whole run). Validation, ``xrlhf plan`` and ``layout: auto`` read them."""

from __future__ import annotations

import subprocess


def gpu_total_gib() -> float | None:
    """The first GPU's total memory in GiB; ``None`` without a GPU (or without ``nvidia-smi``)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        return float(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def gpu_count() -> int:
    """How many GPUs ``nvidia-smi -L`` lists (at least 1: asked only once a GPU was seen)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in out.stdout.splitlines()))
