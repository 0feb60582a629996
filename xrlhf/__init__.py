"""xrlhf: a layered, multi-engine RLHF platform.

Layers, imported one way only:
``engines`` (one model shard on one device, no Ray) <- ``coordinator`` (Ray handles)
<- ``algorithms`` / ``envs`` (trainer loops, environments) <- ``cli``.
"""

__version__ = "0.1.0"
