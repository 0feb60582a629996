"""Typed, validated configuration: YAML -> pydantic, errors named by their YAML path."""

from xrlhf.config.loader import algorithm_options, dump_config, load_config, validate_dict
from xrlhf.config.schema import XConfig

__all__ = ["XConfig", "algorithm_options", "dump_config", "load_config", "validate_dict"]
