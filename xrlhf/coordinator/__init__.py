"""Coordination layer: model handles as groups of Ray actors, placement, weight sync.

``Coordinator`` and ``ModelHandle`` import Ray, so they are loaded on first use: the shell reads
``coordinator.spec`` (what a run's topology is) without starting or importing Ray.
"""

__all__ = ["Coordinator", "ModelHandle"]


def __getattr__(name: str):
    if name == "Coordinator":
        from xrlhf.coordinator.coordinator import Coordinator

        return Coordinator
    if name == "ModelHandle":
        from xrlhf.coordinator.handle import ModelHandle

        return ModelHandle
    raise AttributeError(f"module 'xrlhf.coordinator' has no attribute {name!r}")
