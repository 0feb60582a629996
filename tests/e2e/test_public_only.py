"""``xrlhf run --public-only``: the quickstart, shortened, on the public APIs of Ray, torch and
transformers alone (every hook of ``xrlhf.internals`` off) ends as the same run with the hooks on:
the hooks buy time, never different weights."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two short runs, each a Ray start-up

REPO = Path(__file__).resolve().parents[2]
SHORT = ["warmup.steps=4", "warmup.batch_size=16", "trainer.steps=2", "trainer.eval_every=0", "trainer.eval_size=8",
         "policy.resources.ranks=1", "checkpoint.every=0"]


def _run(tmp_path: Path, model: str, name: str, *flags: str) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in ("XRLHF_PUBLIC_ONLY", "XRLHF_HOOKS_OFF")}
    done = subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", str(REPO / "configs/quickstart.yaml"),
                           f"policy.model={model}", *SHORT, "--output-dir", str(out), *flags],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    weights = out / "final" / "model.safetensors"
    return done, hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else ""


@pytest.mark.long  # two runs of a minute or more (hooks on, hooks off): make test-all (CI) runs it
def test_public_only_runs_end_to_end_and_ends_with_the_same_weights(tmp_path, tiny_model):
    public, public_weights = _run(tmp_path, tiny_model, "public", "--public-only")
    assert public.returncode == 0, public.stderr[-3000:]
    assert public_weights, "no final weights"
    shipped, shipped_weights = _run(tmp_path, tiny_model, "shipped")
    assert shipped.returncode == 0, shipped.stderr[-3000:]
    assert public_weights == shipped_weights
    assert " is off (" not in public.stderr  # switched off, not failed: no warning lines
