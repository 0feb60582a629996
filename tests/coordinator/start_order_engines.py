"""Engines for ``test_start_order.py``: the Transformers engines, stamping when they are built
(a file per event in ``STAMPS``), one of them declaring ``starts_alone`` as vLLM does."""

from __future__ import annotations

import os
import time
from pathlib import Path

from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine

STAMPS = Path("/tmp/xrlhf-test-start-order")


def stamp(event: str) -> None:
    STAMPS.mkdir(exist_ok=True)
    (STAMPS / f"{event}-{os.getpid()}").write_text(repr(time.time()))


class AloneGenerator(HFGenerateEngine):
    """Sizes nothing from free memory, but says it does: built alone, after the other engines."""

    starts_alone = True

    def __init__(self, spec):
        stamp("alone-start")
        super().__init__(spec)
        stamp("alone-end")


class SlowInfer(HFInferEngine):
    """A reference that takes a second to build: long enough to see what overlaps it."""

    def __init__(self, spec):
        stamp("infer-start")
        time.sleep(1.0)
        super().__init__(spec)
        stamp("infer-end")
