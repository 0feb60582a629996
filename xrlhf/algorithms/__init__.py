"""Algorithm layer: pure losses and advantages (``functional``, ``estimators``) and the short
trainer loops that use them, registered by name (``algorithm.name`` in YAML). Trainers talk
to model handles only; nothing here imports Ray.
"""

from xrlhf.algorithms.base import ALGORITHMS, RLTrainer, Rollout, Trainer, register_algorithm
from xrlhf.algorithms import ppo  # noqa: F401  (registers "ppo")
from xrlhf.algorithms import critic_free, distill, dpo, kto, reward_model  # noqa: F401  (grpo & co, distill, ...)

__all__ = ["ALGORITHMS", "RLTrainer", "Rollout", "Trainer", "register_algorithm"]
