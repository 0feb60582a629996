"""The critic of an actor-critic update (PPO): its values before the advantages, its step beside
the policy's. A part the policy-gradient update holds only when the algorithm has a critic, so
the critic-free families carry no critic code path at all."""

from __future__ import annotations

from xrlhf.algorithms import functional as F
from xrlhf.algorithms.losses import ValueLoss
from xrlhf.data.batch import Batch
from xrlhf.engines.handles import Handle, Pending


class Critic:
    """The value model trained beside the policy.

    Args:
        handle: the critic handle (``infer`` gives ``values``; ``train_step`` takes the loss).
        value_clip_eps: the clipped value loss's range around the rollout-time values
            (``None``: unclipped).
    """

    def __init__(self, handle: Handle, value_clip_eps: float | None):
        self.handle, self.loss = handle, ValueLoss(value_clip_eps)

    def values(self, batch: Batch) -> Pending:
        """The critic's forward over ``batch``, sent now; ``.get()["values"]`` is ``[B, R]``."""
        return self.handle.infer(batch, wait=False)

    def train_step(self, mb: Batch) -> Pending:
        """One step of the value loss on mini-batch ``mb`` (``old_values``, ``returns``), sent now:
        the caller sends it before the policy's so that both run side by side."""
        return self.handle.train_step(mb, self.loss, wait=False)

    @staticmethod
    def metrics(batch: Batch, metrics: dict[str, float]) -> dict[str, float]:
        """``critic/return_mean`` of the trained batch, and ``policy/loss`` and ``critic/loss``
        present (0.0) where no step reported them."""
        return {"critic/return_mean": float(F.masked_mean(batch["returns"], batch["response_mask"])),
                "policy/loss": metrics.get("policy/loss", 0.0), "critic/loss": metrics.get("critic/loss", 0.0)}
