"""Typed configuration: YAML -> pydantic, errors named by their YAML path.

A leaf of the package (it imports nothing of xrlhf but ``xrlhf.utils``): the checks that need
registries (engines, algorithms, envs, reward functions) live in ``xrlhf.validation``.
"""

from xrlhf.config.loader import apply_overrides, dump_config, format_errors, read_yaml
from xrlhf.config.schema import XConfig

__all__ = ["XConfig", "apply_overrides", "dump_config", "format_errors", "read_yaml"]
