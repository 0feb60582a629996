"""The train step, measured: its time, the logprob phase and peak memory by code path, precision and
token budget, and the same step under other engines and algorithms. One command per question:

    python -m benchmarks.train_step [--matrix ...]   # efficiency.py: packed micro-batches + chunked logprobs
                                                     # against the path before issue 16; --matrix: by
                                                     # precision and token budget (train_efficiency*.json)
    python -m benchmarks.train_step sweep ...        # sweep.py: the train peak per token budget, eager and
                                                     # compiled: the plan's activation model (memory_sweep.json)
    python -m benchmarks.train_step ppo ...          # ppo.py: PPO's whole step co-located on one GPU, its
                                                     # phases and peak memory (ppo_step.json)
    python -m benchmarks.train_step deepspeed ...    # zero.py: the DeepSpeed engine's step under ZeRO-2,
                                                     # ZeRO-3, ZeRO-3 + offload, on 2 GPUs (deepspeed.json)

``--help`` after a command gives its options.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"efficiency": "benchmarks.train_step.efficiency", "sweep": "benchmarks.train_step.sweep",
            "ppo": "benchmarks.train_step.ppo", "deepspeed": "benchmarks.train_step.zero"}


def main(argv: list[str] | None = None):
    """``COMMAND [options]``; options alone are ``efficiency``'s (the train step by code path)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = argv.pop(0) if argv[:1] and argv[0] in COMMANDS else "efficiency"
    return importlib.import_module(COMMANDS[name]).main(argv)
