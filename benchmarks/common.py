"""Shared pieces of the benchmarks: the machine, the model, vLLM settings, JSON and tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
MODEL_05B = ROOT / "artifacts" / "model-0.5b"


def gpu_name() -> str:
    """The first GPU's name and memory, e.g. ``NVIDIA H100 80GB HBM3 (79.2 GiB) x1``."""
    import torch

    if not torch.cuda.is_available():
        return "none"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} ({p.total_memory / 2**30:.1f} GiB) x{torch.cuda.device_count()}"


def ensure_model(path: str | Path = MODEL_05B, preset: str = "0.5b", dtype: str = "bfloat16") -> str:
    """The locally built model at ``path`` (built from ``preset`` if missing); absolute path."""
    from xrlhf.models.tiny import PRESETS, build_model

    path = Path(path)
    if not (path / "config.json").is_file():
        build_model(path, **PRESETS[preset], dtype=dtype)
    return str(path.resolve())


def model_params(path: str) -> int:
    from xrlhf.models.tiny import count_params

    return count_params(path)


def vllm_options(**fields) -> dict[str, Any]:
    """``EngineSpec.options`` for a vLLM engine: ``fields`` + the JSON in ``XRLHF_VLLM``."""
    from xrlhf.engines.vllm import VLLMOptions  # light: vLLM is imported only to build an engine

    over = json.loads(os.environ.get("XRLHF_VLLM") or "{}")
    engine_options = {**fields.pop("engine_options", {}), **over.pop("engine_options", {})}
    return VLLMOptions(engine="vllm", **{**fields, **over}, engine_options=engine_options).model_dump()


def cli_overrides() -> list[str]:
    """``XRLHF_VLLM`` as ``policy.generate.<field>=<value>`` overrides of a YAML config."""
    over = json.loads(os.environ.get("XRLHF_VLLM") or "{}")
    return [f"policy.generate.{k}={json.dumps(v)}" for k, v in over.items()]


def write_json(out_dir: str | Path, name: str, data: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {**data, "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "versions": versions()}
    path = out / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def versions() -> dict[str, str]:
    out = {}
    for mod in ("torch", "vllm", "transformers", "ray"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - reporting only
            pass
    return out


def table(rows: Iterable[Iterable[Any]], header: Iterable[str]) -> str:
    """A plain text table (what each benchmark prints at the end)."""
    rows = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    header = list(header)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


class DeviceMemorySampler:
    """The GPU's used memory and utilisation sampled by ``nvidia-smi`` every ``period_ms`` (no CUDA
    context in this process, so it perturbs nothing): ``peak()`` memory in GiB and mean
    ``utilization()`` in % (the share of time a kernel ran, as the driver reports it), both since
    the last ``reset()``. A utilisation well under 100% while generating means the host, not the
    GPU, sets the pace."""

    def __init__(self, gpu: int | None = None, period_ms: int = 50):
        """``gpu``: nvidia-smi's index; default the first of ``CUDA_VISIBLE_DEVICES`` (else 0)."""
        import threading

        if gpu is None:
            gpu = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])

        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--id={gpu}", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits",
             f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self._peak = 0.0
        self._util: list[float] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                mib, util = (float(x) for x in line.split(","))
            except ValueError:
                continue
            with self._lock:
                self._peak = max(self._peak, mib / 1024)
                self._util.append(util)

    def reset(self) -> None:
        with self._lock:
            self._peak = 0.0
            self._util = []

    def peak(self) -> float:
        with self._lock:
            return self._peak

    def utilization(self) -> float | None:
        with self._lock:
            return round(sum(self._util) / len(self._util), 1) if self._util else None

    def close(self) -> None:
        self.proc.terminate()
