"""W's train-step peak memory against the micro-batch's token budget, eager and with compiled layers:
what the plan's activation model (``xrlhf.plan.memory.train_bytes_per_token``) is checked against.

Why (issue 28): at an H100's derived budget (~29k tokens) the plan put W's train step within 2%
of the measured peak; at an H200's (~61k) it over-states it by 15-20%, and compiled layers (the
GPU default since 2026-11-26) keep fewer activations (docs/plan.md, "Known over-estimate"). One
measurement per budget shows whether the bytes per token are constant (a fixed part mis-counted)
or fall with the micro-batch (an allocator or kernel effect), and gives the compiled figure.

For each of eager and compiled layers: the policy (mixed precision, the GPU default) and the
bf16 reference in one process, as ``train_step --matrix`` runs them; W's batch; for each
budget one warm-up step, then one timed step with the peak allocation reset before it. Each row:
the budget, the largest micro-batch's tokens, the micro-batch count, the step's seconds and its
peak (``torch.cuda.max_memory_allocated``). Writes ``memory_sweep.json``::

    python -m benchmarks.train_step sweep --out $OUT                # one GPU, ~3 minutes
    python -m benchmarks.train_step sweep --smoke --out /tmp/sweep  # a tiny model on the CPU: it runs
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ensure_model, gpu_name, table, write_json
from benchmarks.train_step.efficiency import SMOKE_W, W, _peak, _reset, _sync, make_batch, precision_policy, w_loss

BUDGETS = (8192, 16384, 32768, 49152, 61440)
SMOKE_BUDGETS = (64, 128)


def sweep(model: str, device: str, budgets: tuple[int, ...], compile: bool, batch) -> list[dict[str, Any]]:
    """One row per budget for one policy engine (``compile``: compiled layers); see the module docstring."""
    import torch

    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.hf import HFInferEngine

    policy = precision_policy(model, device, "mixed" if device == "cuda" else "bf16", compile=compile)
    reference = HFInferEngine(EngineSpec(model, device=device, options={"dtype": "bfloat16", "compile": compile}))
    reference.infer(batch.select("input_ids", "attention_mask", "response_mask"))  # resident, as in a run
    rows = []
    for budget in budgets:
        policy.options.micro_batch_size = len(batch)
        policy.options.max_tokens_per_micro_batch = budget
        tokens = [int(part["attention_mask"].sum()) for _, part in policy.micro_batches(batch)]
        try:
            policy.train_step(batch, w_loss())  # warm-up: compiles (a new shape) and allocates
            _sync(device)
            _reset(device)
            t0 = time.perf_counter()
            policy.train_step(batch, w_loss())
            _sync(device)
        except torch.OutOfMemoryError:  # the card's limit (an H100 at the H200's budgets): larger ones fail too
            policy.optimizer.zero_grad(set_to_none=True)
            for param in policy.model.parameters():
                param.grad = None
            print({"compile": compile, "budget": budget, "oom": True}, flush=True)
            rows.append({"compile": compile, "budget": budget, "largest_micro_batch_tokens": max(tokens),
                         "micro_batches": len(tokens), "oom": True})
            break
        row = {"compile": compile, "budget": budget, "largest_micro_batch_tokens": max(tokens),
               "micro_batches": len(tokens), "train_s": time.perf_counter() - t0, "peak_gib": _peak(device)}
        print(row, flush=True)
        rows.append(row)
    del policy, reference
    _reset(device)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_step sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (the script runs, in seconds)")
    args = ap.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        model = ensure_model(Path(tempfile.mkdtemp(prefix="xrlhf-sweep-")) / "tiny", preset="tiny", dtype="float32")
        w, budgets = SMOKE_W, SMOKE_BUDGETS
    else:
        model, w, budgets = ensure_model(), W, BUDGETS
    from transformers import AutoConfig

    batch = make_batch(w, AutoConfig.from_pretrained(model).vocab_size)
    rows = [r for compile in (False, True) for r in sweep(model, device, budgets, compile, batch)]
    data = {"gpu": gpu_name(), "device": device, "model": model, "sequences": w.sequences,
            "tokens": int(batch["attention_mask"].sum()), "rows": rows,
            "command": "python -m benchmarks.train_step sweep" + (" --smoke" if args.smoke else "")}
    print(table([[r["compile"], r["budget"], r["largest_micro_batch_tokens"], r["micro_batches"], r.get("train_s"),
                  r.get("peak_gib", "out of memory")] for r in rows], ["compiled", "budget", "largest", "micro-batches", "train s", "peak GiB"]))
    write_json(args.out, "memory_sweep.json", data)
    return data
