"""Every GPU test file runs in some stage of ``benchmarks/gpu.sh``, the one entry point of a GPU
machine: a file that no stage names is never run there."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_gpu_test_file_is_in_a_stage():
    script = (ROOT / "benchmarks" / "gpu.sh").read_text()
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert files
    missing = [f for f in files if f not in script]
    assert not missing, f"no stage of benchmarks/gpu.sh runs {missing}"
