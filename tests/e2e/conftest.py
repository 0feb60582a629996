"""End-to-end runs start one rank of each handle unless two ranks are their point.

Every worker is a process that imports torch and transformers (about 7 CPU-seconds on the 2-core
box): ``base_config``'s two policy ranks and their two generators cost a run two processes more
than one rank does. Two ranks stay where they are the point: ``test_ppo_run``'s full run,
the kill-and-resume scenarios, DeepSpeed ZeRO-3 and LoRA on it, the healing scenario, and
``tests/coordinator/test_data_parallel.py`` (two ranks equal one).
"""

from __future__ import annotations

import pytest


@pytest.fixture()
def base_config(base_config: dict) -> dict:
    """``tests/conftest.py``'s config with one policy rank (and so one generator)."""
    base_config["policy"]["resources"] = {"ranks": 1}
    return base_config

