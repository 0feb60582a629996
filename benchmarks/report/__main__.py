"""``python -m benchmarks.report``: docs/benchmarks.md from benchmarks/results/."""

from benchmarks.report import main

main()
