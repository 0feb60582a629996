"""Recovery from faults, measured on runs: a run SIGKILLed at a random moment and resumed ends as
an uninterrupted one (``chaos``, issue 49: ``chaos.py``); a worker of every role killed or frozen
mid-step heals in place, and the time each fault costs (``heal``: ``healing.py``).

    python -m benchmarks.recovery chaos --out benchmarks/results     # CPU, ~25 minutes on 2 cores: chaos.json, chaos.md
    python -m benchmarks.recovery heal --out benchmarks/results      # CPU, ~4 minutes: healing.json
    python -m benchmarks.recovery heal --gpu --gpus 2 --out OUT      # vLLM's generator killed and healed: healing_gpu2.json
"""

from __future__ import annotations

import sys

COMMANDS = ("chaos", "heal")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["chaos"]:
        from benchmarks.recovery.chaos import main as chaos
        return chaos(argv[1:])
    if argv[:1] == ["heal"]:
        from benchmarks.recovery.healing import main as heal
        return heal(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return None
    sys.exit(f"usage: python -m benchmarks.recovery {{{','.join(COMMANDS)}}} [options] (--help after one)\n\n{__doc__}")
