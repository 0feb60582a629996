"""Engines for ``test_start_order.py``: the Transformers engines, stamping when they are built
(a file per event in the directory of their option ``stamps``: the test's own tmp_path), one of
them declaring ``starts_alone`` as vLLM does."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import Field

from xrlhf.engines.hf import HFGenerateEngine, HFGenerateOptions, HFInferEngine, HFInferOptions


class StampGenerateOptions(HFGenerateOptions):
    stamps: str = Field(description="the directory build events are stamped into")


class StampInferOptions(HFInferOptions):
    stamps: str = Field(description="the directory build events are stamped into")


def stamp(options, event: str) -> None:
    stamps = Path(options["stamps"] if isinstance(options, dict) else options.stamps)
    stamps.mkdir(exist_ok=True)
    (stamps / f"{event}-{os.getpid()}").write_text(repr(time.time()))


class AloneGenerator(HFGenerateEngine):
    """Sizes nothing from free memory, but says it does: built alone, after the other engines;
    and imports something at ``preload`` (stamped), as vLLM does."""

    Options = StampGenerateOptions
    starts_alone = True

    @classmethod
    def preload(cls, options) -> None:
        stamp(options, "preload")

    def __init__(self, spec):
        stamp(spec.options, "alone-start")
        super().__init__(spec)
        stamp(spec.options, "alone-end")


class SlowInfer(HFInferEngine):
    """A reference that takes a second to build: long enough to see what overlaps it."""

    Options = StampInferOptions

    def __init__(self, spec):
        stamp(spec.options, "infer-start")
        time.sleep(1.0)
        super().__init__(spec)
        stamp(spec.options, "infer-end")


class RayShyGenerator(AloneGenerator):
    """``AloneGenerator`` whose preload also imports a module that takes Ray if it can (``ray_shy``)."""

    @classmethod
    def preload(cls, options) -> None:
        import tests.coordinator.ray_shy  # noqa: F401

        super().preload(options)


class BrokenPreload(AloneGenerator):
    """A preload that fails (a missing package, say): the build reports it, not the preload."""

    @classmethod
    def preload(cls, options) -> None:
        raise ImportError("no module named 'not_installed'")
