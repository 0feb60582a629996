"""The layer rules of docs/architecture.md, pinned: imports go one way.

Each check imports one layer in a fresh interpreter and looks at what came with it:

* ``engines``, ``algorithms``, ``envs``, ``config``, ``data``, ``weight_sync`` import no Ray, and
  none of them imports vLLM or DeepSpeed just by being imported (backends load those when an
  engine is built);
* ``engines`` import nothing above them (no coordinator, algorithms, envs, runner, cli);
* ``config`` is a leaf: it imports no other xrlhf package but ``xrlhf.utils``.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import xrlhf

PACKAGES = sorted(m.name for m in pkgutil.iter_modules(xrlhf.__path__))


def loaded_after(modules: list[str]) -> set[str]:
    """Top-level and xrlhf module names in ``sys.modules`` after importing ``modules`` afresh, with
    every module of their packages, subpackages included (``engines.vllm.loop``...)."""
    code = ("import importlib, json, pkgutil, sys\n"
            f"for name in {modules!r}:\n"
            "    m = importlib.import_module(name)\n"
            "    for sub in pkgutil.walk_packages(getattr(m, '__path__', []), name + '.'):\n"
            "        importlib.import_module(sub.name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def xrlhf_packages(mods: set[str]) -> set[str]:
    return {m.split(".")[1] for m in mods if m.startswith("xrlhf.") and m.count(".") >= 1}


@pytest.mark.parametrize("layer", [p for p in ("engines", "algorithms", "envs", "config", "data", "weight_sync")
                                   if p in PACKAGES])
def test_layer_imports_no_ray_vllm_or_deepspeed(layer):
    mods = loaded_after([f"xrlhf.{layer}"])
    heavy = {m.split(".")[0] for m in mods} & {"ray", "vllm", "deepspeed"}
    assert not heavy, f"importing every module of xrlhf.{layer} loaded {sorted(heavy)}"


def test_engines_import_nothing_above_them():
    above = xrlhf_packages(loaded_after(["xrlhf.engines"])) & {"coordinator", "algorithms", "envs", "runner",
                                                               "cli", "validation", "checkpoint", "report"}
    assert not above, f"xrlhf.engines imports {sorted(above)}"


def test_config_is_a_leaf():
    others = xrlhf_packages(loaded_after(["xrlhf.config"])) - {"config", "utils"}
    assert not others, f"xrlhf.config imports {sorted(others)}"


@pytest.mark.parametrize("config", ["quickstart", "gpu/grpo_w", "gpu/ppo_vllm_colocate", "gpu/ppo_vllm_split"])
def test_the_trainers_process_holds_no_generator_in_any_layout(config, tiny_model):
    """The generators are a handle of their own, ``rollout``, co-located or not: the policy's
    workers build its train engine only, and building that imports no vLLM (so the trainer's
    Python never shares a GIL with vLLM's client loop)."""
    from pathlib import Path

    import yaml

    from xrlhf.config.schema import XConfig
    from xrlhf.topology import topology

    data = yaml.safe_load((Path(__file__).parents[1] / "configs" / f"{config}.yaml").read_text())
    data["policy"]["model"] = tiny_model
    t = topology(XConfig.model_validate(data), tiny_model)
    policy, rollout = t.spec("policy"), t.spec("rollout")
    assert list(policy.engines) == ["train"] and list(rollout.engines) == ["generate"]
    assert t.weight_sync.colocated == (data["policy"]["generate"].get("resources") is None)
    train = policy.engines["train"][0]
    code = ("import sys\nfrom xrlhf.engines.base import engine_class\nfrom xrlhf.engines.host import EngineHost\n"
            f"engine_class({train!r}, 'train')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.startswith('xrlhf.engines.vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
