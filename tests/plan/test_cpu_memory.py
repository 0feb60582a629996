"""The plan's trainer state against the resident memory of a real CPU training engine (issue 28).

A 25M-parameter fp32 Llama (6 layers x 512, ``P`` parameters) trains with the ``hf.train`` engine
in a process of its own, so its resident memory (``/proc/self/status``) is the engine's alone;
the plan (``plan/memory.py``) is made for the same shape and options. Checked within 15%, the
issue's bound for trainer peaks:

* loaded: the weights (4P);
* between steps, after the first: the weights and AdamW's states (4P + 8P). The plan's gradients
  (4P) are not resident then: ``optimizer_step`` frees them (``zero_grad(set_to_none=True)``) and
  the next backward makes them again, so they count in a step's peak, not between steps;
* a step's peak: weights, gradients and AdamW's states (16P) and the activations of its largest
  micro-batch (``train_bytes_per_token`` x its tokens, and the chunked head's logits);
* the activations alone: the peak of a step of 256-token micro-batches less that of 16-token ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LONG = 256
"""Tokens of each micro-batch of the step that checks the activations (two rows, one each)."""
SHORT = 16
"""Tokens of each micro-batch of the first step: a few MiB of activations beside 16P."""
MIB = 2**20

# slow: a training process of its own, about 16 s of CPU (23-54 s on a loaded 2-core machine)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")]


def child_env() -> dict[str, str]:
    """The measuring process's environment.

    ``MALLOC_MMAP_THRESHOLD_``: glibc raises its mmap threshold (up to 32 MiB) each time a large
    block is freed, so later gradients and activations come from its heap, which keeps them
    resident once freed. With its default this engine measured 322 MiB after the first step for
    a planned 289 (+11%), 399 MiB after a second short one (16P: the freed gradients stay), a
    530 MiB peak of the long step for 470 planned and 120 MiB of activations for 78: memory free
    but held, as CUDA's caching allocator holds reserved memory, which the plan does not count
    either (it counts what is allocated). A fixed threshold hands every block of 128 KiB or more
    back to the kernel when freed, so the RSS follows the live tensors (all five within 4%).
    ``OMP_NUM_THREADS=1``: on a loaded 2-core machine two OpenMP threads wait on each other (the
    engine's start-up probes took 11 s instead of 0.3); the memory is the same.
    """
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def measured(tiny_model, tmp_path_factory) -> tuple[str, dict[str, int]]:
    from xrlhf.models.tiny import build_model

    model = str(build_model(tmp_path_factory.mktemp("cpu_memory") / "model", layers=6, hidden=512, heads=8,
                            max_positions=2 * LONG, seed=0))
    run = subprocess.run([sys.executable, __file__, tiny_model, model], env=child_env(), capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return model, json.loads(run.stdout.strip().splitlines()[-1])


def planned(model: str, tokens: int) -> tuple[dict[str, int], int]:
    """The plan's trainer state once stepped (bytes by part: weights, gradients, AdamW's states) and
    the activations of a ``tokens``-token micro-batch."""
    from xrlhf.plan.memory import (
        Trainer,
        head_working,
        train_bytes_per_token,
        trainer_state,
    )
    from xrlhf.plan.shapes import model_shape

    shape = model_shape(model)
    t = Trainer(precision="fp32", tokens=tokens)  # the engine's defaults: fp32 on CPU, chunked head
    act = tokens * train_bytes_per_token(shape, t) + head_working(shape, "causal_lm", t.chunk, True)
    return trainer_state(shape, t), act


def test_loaded_weights_and_state_between_steps(measured):
    model, m = measured
    state, _ = planned(model, SHORT)
    # loaded fp32 from fp32 safetensors, the weights are the file mapped (page cache, RssFile) until
    # the first step writes them; resident either way
    assert (m["loaded"] - m["start"]) / MIB == pytest.approx(state["weights"] / MIB, rel=0.15)
    between = state["weights"] + state["optimizer"]  # gradients freed: see the module docstring
    assert (m["stepped"] - m["start"]) / MIB == pytest.approx(between / MIB, rel=0.15)


def test_step_peaks_and_activations(measured):
    model, m = measured
    state, short = planned(model, SHORT)
    _, long = planned(model, LONG)
    full = sum(state.values())
    assert (m["peak_short"] - m["start"]) / MIB == pytest.approx((full + short) / MIB, rel=0.15)
    assert (m["peak_long"] - m["start"]) / MIB == pytest.approx((full + long) / MIB, rel=0.15)
    # both peaks hold the same 16P; what differs is the largest micro-batch's activations
    assert (m["peak_long"] - m["peak_short"]) / MIB == pytest.approx((long - short) / MIB, rel=0.15)


# --- the measuring process: `python test_cpu_memory.py TINY_MODEL MODEL` prints one JSON line ---


def resident() -> dict[str, int]:
    """Resident (VmRSS) and peak resident (VmHWM) bytes of this process."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def reset_peak() -> None:
    """Restart VmHWM from the current RSS (Linux's ``clear_refs`` 5), to read one phase's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def sft_batch(rows: int, tokens: int):
    """``rows`` sequences of ``tokens`` ids (half prompt, half response) from the char vocabulary."""
    import torch

    from xrlhf.data.batch import build_sequences

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, 100, (tokens,), generator=g).tolist() for _ in range(rows)]
    return build_sequences([r[:tokens // 2] for r in ids], [r[tokens // 2:] for r in ids], pad_id=0)


def measure(tiny_model: str, model: str) -> dict[str, int]:
    """RSS at each phase of a CPU train engine's life, in bytes (peaks: VmHWM since the phase began)."""
    import gc

    from xrlhf.algorithms.losses import SFTLoss
    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.hf import HFTrainEngine

    # one row per micro-batch: the second micro-batch's forward runs beside the first's gradients
    # and AdamW's states, the moment the plan's peak (16P + activations) describes
    def engine(path):
        return HFTrainEngine(EngineSpec(path, options={"lr": 1e-3, "micro_batch_size": 1}, seed=0))

    # a tiny engine first, so that the lazy imports, the probes' kernels and the thread pools are
    # already in the baseline and not counted as the model's
    warm = engine(tiny_model)
    warm.train_step(sft_batch(2, SHORT), SFTLoss())
    del warm
    gc.collect()
    out = {"start": resident()["VmRSS"]}
    e = engine(model)
    out["loaded"] = resident()["VmRSS"]
    reset_peak()
    e.train_step(sft_batch(2, SHORT), SFTLoss())
    now = resident()
    out["stepped"], out["peak_short"] = now["VmRSS"], now["VmHWM"]
    reset_peak()
    e.train_step(sft_batch(2, LONG), SFTLoss())
    out["peak_long"] = resident()["VmHWM"]
    return out


if __name__ == "__main__":
    print(json.dumps(measure(*sys.argv[1:3])))
