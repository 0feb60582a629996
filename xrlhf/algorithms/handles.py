"""The seam between trainers and models: what a trainer may call, as typed Protocols.

Why: a trainer must not care whether a model runs as Ray actors over several GPUs
(``coordinator.ModelHandle``, gathered by ``coordinator.Coordinator``) or in this process
(``algorithms.local.LocalHandle`` / ``LocalHandles``: tests, the warm-up). Both run the calls
declared once in ``engines.calls.HandleCalls``, so a trainer reads ``handles.critic`` (``None``
when the run has none) instead of probing with ``getattr``/``hasattr``. No Ray here.

Every data-parallel call splits its first argument over the handle's ranks, padding to equal
parts and dropping the padding on the way back (``xrlhf.data.dispatch``): a trainer passes a
batch of any size. ``wait=False`` returns a ``Pending`` whose ``get()`` gathers later, so the
calls of independent handles overlap.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from xrlhf.engines.calls import HandleCalls


@runtime_checkable
class Pending(Protocol):
    """A call still running on a handle's ranks."""

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank and gather their results as the blocking call would."""


Handle = HandleCalls
"""One model over ``world_size`` ranks: the calls of ``xrlhf.engines.calls.HandleCalls``, each
with its dispatch (``generate``, ``infer``, ``train_step``, ...), declared once for the Ray and
the in-process handles."""


@runtime_checkable
class Handles(Protocol):
    """The models of a run, and the two moments the trainer tells them about.

    Attributes:
        policy: the trained model (a reward model being trained, too).
        generator: the handle that samples (``rollout``; in process, the policy's own generate
            engine when it has one).
        critic, reference, reward, teacher: ``None`` when the run has none.
    """

    @property
    def policy(self) -> Handle: ...

    @property
    def generator(self) -> Handle: ...

    @property
    def critic(self) -> Handle | None: ...

    @property
    def reference(self) -> Handle | None: ...

    @property
    def reward(self) -> Handle | None: ...

    @property
    def teacher(self) -> Handle | None: ...

    def sync_weights(self, version: int | None = None) -> float:
        """Push the policy's new weights to the generate engines; returns seconds taken.
        ``version``: the policy version they are (stamped on the tokens sampled with them)."""

    def end_rollout(self) -> None:
        """Generation is over until the next ``sync_weights`` (co-located generators free memory)."""

    def memory(self) -> dict[str, list[dict[str, float]]]:
        """Every handle's ranks' ``memory_stats`` (peaks reset): ``{handle: [per rank]}``."""
