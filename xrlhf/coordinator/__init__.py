"""Coordination layer: model handles as groups of Ray actors, placement, weight sync."""

from xrlhf.coordinator.coordinator import Coordinator
from xrlhf.coordinator.handle import ModelHandle

__all__ = ["Coordinator", "ModelHandle"]
