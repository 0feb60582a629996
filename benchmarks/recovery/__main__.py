"""``python -m benchmarks.recovery chaos|heal ...``."""

from benchmarks.recovery import main

main()
