"""``python -m benchmarks.train_step [COMMAND] ...``: see ``benchmarks.train_step``."""

import sys

from benchmarks.train_step import main

result = main()
sys.exit(result if isinstance(result, int) else 0)
