"""The seam between trainers and models: what a trainer may call, as typed Protocols.

Why: a trainer must not care whether a model runs as Ray actors over several GPUs
(``coordinator.ModelHandle``, gathered by ``coordinator.Coordinator``) or in this process
(``algorithms.local.LocalHandle`` / ``LocalHandles``: tests, the warm-up). Both satisfy these
Protocols with real methods and attributes, so a trainer reads ``handles.critic`` (``None``
when the run has none) instead of probing with ``getattr``/``hasattr``. No Ray here.

Every data-parallel call splits its first argument over the handle's ranks, padding to equal
parts and dropping the padding on the way back (``xrlhf.data.dispatch``): a trainer passes a
batch of any size. ``wait=False`` returns a ``Pending`` whose ``get()`` gathers later, so the
calls of independent handles overlap.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from xrlhf.data.batch import Batch
from xrlhf.engines.base import GenerationOutput, LossFn, SamplingParams


@runtime_checkable
class Pending(Protocol):
    """A call still running on a handle's ranks."""

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank and gather their results as the blocking call would."""


@runtime_checkable
class Handle(Protocol):
    """One model (policy, critic, reference, reward, rollout) over ``world_size`` ranks.

    Attributes:
        name: ``policy``, ``critic``, ``reference``, ``reward`` or ``rollout``.
        trainable: whether its ranks hold a train engine (then it is checkpointed).
    """

    name: str
    trainable: bool

    @property
    def world_size(self) -> int:
        """The number of data-parallel ranks."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None, *,
                 wait: bool = True) -> GenerationOutput | Pending:
        """One continuation per token-id prompt: ``B`` lists of token ids, their logprobs and
        versions; ``seeds``: one per prompt, for sampling that does not depend on the split
        (``GenerateEngine.generate``)."""

    def generate_on(self, rank: int, prompts: list[list[int]], params: SamplingParams,
                    seeds: list[int] | None = None, *, wait: bool = True) -> GenerationOutput | Pending:
        """``generate`` on rank ``rank`` only, no padding copies (an episode's turns stay on one
        generator; ``algorithms.episodes``)."""

    def infer(self, batch: Batch, *, wait: bool = True) -> Batch | Pending:
        """``logprobs`` / ``values`` ``[B, R]`` or ``scores`` ``[B]`` of ``batch``, no gradients."""

    def train_step(self, batch: Batch, loss_fn: LossFn, *, wait: bool = True) -> dict[str, float] | Pending:
        """One optimizer step on the global mini-batch ``batch`` -> metrics (means over its units)."""

    def save_pretrained(self, path: str, *, wait: bool = True) -> Any:
        """Write the trained model in HF format to ``path``."""

    def state_dict(self, *, wait: bool = True) -> dict[str, Any] | Pending:
        """Model, optimizer and scheduler state, for exact resume."""

    def load_state_dict(self, state: dict[str, Any], *, wait: bool = True) -> Any:
        """Restore what ``state_dict`` returned, on every rank."""

    def save_state(self, path: str, *, wait: bool = True) -> Any:
        """Every rank writes its part of the training state into the directory ``path``."""

    def load_state(self, path: str, *, wait: bool = True) -> Any:
        """Every rank restores its part from what ``save_state`` wrote to ``path``."""

    def rng_state(self, *, wait: bool = True) -> list[dict[str, Any]] | Pending:
        """Every rank's RNG state."""

    def set_rng_state(self, states: list[dict[str, Any]]) -> None:
        """Restore every rank's RNG state (``rng_state``'s list)."""


@runtime_checkable
class Handles(Protocol):
    """The models of a run, and the two moments the trainer tells them about.

    Attributes:
        policy: the trained model (a reward model being trained, too).
        generator: the handle that samples: the policy's own generate engines, or the
            generators' ``rollout`` handle in the split layout.
        critic, reference, reward: ``None`` when the run has none.
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

    def sync_weights(self, version: int | None = None) -> float:
        """Push the policy's new weights to the generate engines; returns seconds taken.
        ``version``: the policy version they are (stamped on the tokens sampled with them)."""

    def end_rollout(self) -> None:
        """Generation is over until the next ``sync_weights`` (co-located generators free memory)."""

    def memory(self) -> dict[str, list[dict[str, float]]]:
        """Every handle's ranks' ``memory_stats`` (peaks reset): ``{handle: [per rank]}``."""
