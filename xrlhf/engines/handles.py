"""The seam between trainers and models, in one place: ``HandleCalls`` (one model over its
ranks) and ``Handles`` (the models of a run).

A handle is one model over ``world_size`` ranks, each rank an ``EngineHost``. What a call does
on a rank is the host's method of the same name; how the call is spread over the ranks and how
the results come back is its *dispatch* (``xrlhf.data.dispatch``: ``DP`` splits the first
argument, ``ALL`` calls every rank, ...), declared here once with ``@call`` in the manner of
verl's ``@register(dispatch_mode=...)``; ``wait=False`` returns a ``Pending``. Two sets of classes
implement the seam and behave the same (tests/algorithms/test_handles_seam.py runs one table of
calls on both): the Ray ``coordinator.ModelHandle`` and ``Coordinator`` (actors, futures,
healing), and the in-process ``algorithms.local.LocalHandle`` and ``LocalHandles`` (tests, the
warm-up). A handle implements ``_dispatch`` (and ``base_reference``); the run's models implement
``sync_weights``, ``end_rollout`` and ``memory``. No Ray here.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol, runtime_checkable

from xrlhf.data.dispatch import ALL, DP, DP_TRAIN, EACH, ONE, RANK0
from xrlhf.engines.training import merge_rank_states


@runtime_checkable
class Pending(Protocol):
    """A call still running on a handle's ranks (``wait=False``)."""

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank and gather their results as the blocking call would."""


def call(mode: str, gather: Callable[[list[Any]], Any] | None = None, split_kwargs: tuple[str, ...] = (),
         group: str | None = None, target: str | None = None, redo: bool = True):
    """Declare a handle method's dispatch; the body is not run.

    ``gather`` replaces the mode's way of combining the ranks' results; ``split_kwargs`` are
    per-row keyword arguments split like the first (``dispatch.plan``); ``group``: the Ray
    concurrency group the call runs in (``rollout``: generation, beside the default group's
    other calls); ``target``: the host method called (default: the handle method's name);
    ``redo``: after its handle was restarted in place, the call is sent again to the new workers
    (``False`` for a weight sync's steps: the restart syncs the weights whole, and one bucket sent
    again would leave the generator waiting for a sync's end). Every declared method takes
    ``wait`` (``False``: a ``Pending`` whose ``get()`` gathers later).
    """

    def deco(fn):
        method = target or fn.__name__
        names = list(inspect.signature(fn).parameters)[1:]  # after self

        @functools.wraps(fn)
        def wrapper(self: "HandleCalls", *args, wait: bool = True, **kwargs):
            if split_kwargs and len(args) > 1:  # per-row arguments given by position: split them by name
                kwargs.update({n: a for n, a in zip(names[1:], args[1:]) if n in split_kwargs})
                args = args[:1] + tuple(a for n, a in zip(names[1:], args[1:]) if n not in split_kwargs)
            return self._dispatch(mode, method, args, kwargs, wait=wait, gather=gather, split_kwargs=split_kwargs,
                                  group=group, redo=redo)

        wrapper.dispatch_mode = mode
        return wrapper

    return deco


class HandleCalls(ABC):
    """The calls of a model handle (policy, critic, reference, reward, rollout); see the module.

    Attributes:
        name: the handle's name.
        trainable: whether its ranks hold a train engine (then it is checkpointed).
    """

    name: str
    trainable: bool

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of ranks."""

    def base_reference(self) -> "HandleCalls":
        """The reference as this handle's base: its ranks, ``infer`` with the LoRA adapters off,
        no state of its own (``reference.from_policy_base``)."""
        raise NotImplementedError(f"{type(self).__name__} has no base reference")

    @abstractmethod
    def _dispatch(self, mode: str, method: str, args: tuple, kwargs: dict, *, wait: bool,
                  gather: Callable | None, split_kwargs: tuple[str, ...], group: str | None, redo: bool = True) -> Any:
        """Run ``method`` on the ranks as ``mode`` says; the result, or a ``Pending`` when not ``wait``."""

    # -- compute ------------------------------------------------------------------------------
    @call(DP, split_kwargs=("seeds",), group="rollout")
    def generate(self, prompts, params, seeds=None):
        """One continuation per token-id prompt (``B`` lists of ids, their logprobs and versions),
        prompts and ``seeds`` (one per prompt) split across ranks -> ``GenerationOutput``."""

    @call(ONE, group="rollout", target="generate")
    def generate_on(self, rank, prompts, params, seeds=None):
        """``generate`` on rank ``rank`` only, no padding copies (an episode's turns stay on one
        generator) -> ``GenerationOutput``."""

    @call(DP)
    def infer(self, batch):
        """``logprobs`` / ``values`` ``[B, R]`` or ``scores`` ``[B]`` of ``batch``, no gradients -> ``Batch``."""

    @call(DP)
    def infer_base(self, batch):
        """Logprobs of ``batch`` under the train engines' start model (LoRA adapters off) -> ``Batch``."""

    @call(DP_TRAIN)
    def train_step(self, batch, loss_fn):
        """One optimizer step on the global mini-batch ``batch`` -> metrics, unit-weighted means."""

    # -- weights ------------------------------------------------------------------------------
    @call(EACH, redo=False)
    def set_transport(self, options, name):
        """Every rank builds its side of transport ``name`` with its own ``options`` -> names."""

    @call(ALL, redo=False)
    def sync_weights_local(self, version=None):
        """Each rank: its train engine -> its own generate engine (one process: ``in_process``)."""

    @call(ALL, redo=False)
    def begin_send(self):
        """Every rank starts sending its weights as a message transport's buckets (``next_message``)."""

    @call(ALL, redo=False)
    def next_message(self):
        """Every rank's next bucket (``None`` when it has sent all); the previous one is released."""

    @call(RANK0, redo=False)
    def send_weights(self):
        """Rank 0's weights as every bucket's message at once (use ``wait=False``: keep them in Ray)."""

    @call(RANK0, redo=False)
    def broadcast_weights(self):
        """Rank 0 broadcasts its weights (the receivers must be in ``receive_weights``)."""

    @call(ALL, redo=False)
    def receive_weights(self, messages):
        """Every rank loads the same messages (``None``: a broadcast's) -> tensors loaded per rank."""

    @call(EACH, target="receive_message", redo=False)
    def receive_each(self, messages):
        """Rank ``r`` loads ``messages[r]``, one bucket of its own trainer's (``None``: that trainer
        has sent all) -> tensors loaded per rank."""

    @call(ALL, redo=False)
    def end_sync(self, version=None):
        """A sync is over: the generators hold policy ``version`` and get their memory back."""

    @call(ALL, redo=False)
    def release_memory(self):
        """Every rank returns its cached accelerator memory (before a co-located generator wakes)."""

    @call(ALL)
    def weight_checksums(self, role):
        """Per rank: checksums by HF name of the ``"train"`` or ``"generate"`` engine's weights."""

    # -- memory phases ------------------------------------------------------------------------
    @call(ALL)
    def sleep_generator(self):
        """Release the generate engines' memory until the next sync."""

    @call(ALL)
    def wake_generator(self):
        """Bring the generate engines back."""

    @call(ALL)
    def memory_stats(self, reset=True):
        """Per rank: the worker's memory (GiB: resident set; on a GPU its peak and the device's use)."""

    # -- state --------------------------------------------------------------------------------
    @call(ALL)
    def save_pretrained(self, path):
        """Every rank takes part (a ZeRO-3 engine gathers its shards); rank 0 writes HF format."""

    @call(ALL, gather=merge_rank_states)
    def state_dict(self):
        """Model, optimizer and scheduler state: rank 0's where all ranks hold the same after a
        step, the union of the ranks' shards for a sharded engine (``merge_rank_states``)."""

    @call(ALL)
    def load_state_dict(self, state):
        """Every rank restores the same state."""

    @call(ALL)
    def save_state(self, path):
        """Every rank writes its part of the training state into the directory ``path``."""

    @call(ALL)
    def load_state(self, path):
        """Every rank restores its part from what ``save_state`` wrote to ``path``."""

    @call(ALL)
    def rng_state(self):
        """Every rank's RNG state."""

    @call(EACH)
    def set_rng_state(self, states):
        """Rank ``r`` restores ``states[r]`` (``rng_state``'s list)."""

    @call(ALL)
    def pid(self):
        """Every rank's process id."""


Handle = HandleCalls
"""One model over ``world_size`` ranks (the name trainers use)."""

ROLES = ("policy", "rollout", "critic", "reference", "reward", "teacher")
"""The handles a run may have: ``rollout`` is the one that generates."""


class Handles(ABC):
    """The models of a run (``handles``: role -> handle, roles of ``ROLES``), and the moments the
    trainer tells them about. A trainer reads ``handles.critic`` (``None`` when the run has none)
    instead of probing with ``getattr``.

    Attributes:
        handles: the run's handles by role; the policy's base as the reference is not among them
            (it has no workers or state of its own).
        reference_from_policy: the reference is the policy with its LoRA adapters off.
    """

    handles: dict[str, HandleCalls]
    reference_from_policy: bool = False

    @property
    def policy(self) -> HandleCalls:
        """The trained model (a reward model being trained, too)."""
        return self.handles["policy"]

    @property
    def generator(self) -> HandleCalls | None:
        """The handle that samples, ``rollout`` (``None`` when nothing generates)."""
        return self.handles.get("rollout")

    @property
    def critic(self) -> HandleCalls | None:
        return self.handles.get("critic")

    @property
    def reference(self) -> HandleCalls | None:
        """The reference's handle, or the policy's base when ``reference_from_policy``."""
        if self.reference_from_policy and "policy" in self.handles:
            return self.handles["policy"].base_reference()
        return self.handles.get("reference")

    @property
    def reward(self) -> HandleCalls | None:
        return self.handles.get("reward")

    @property
    def teacher(self) -> HandleCalls | None:
        """The teacher of on-policy distillation, or ``None``."""
        return self.handles.get("teacher")

    @abstractmethod
    def sync_weights(self, version: int | None = None) -> float:
        """Push the policy's new weights to the generate engines; returns seconds taken.
        ``version``: the policy version they are (stamped on the tokens sampled with them)."""

    @abstractmethod
    def end_rollout(self) -> None:
        """Generation is over until the next ``sync_weights`` (co-located generators free memory)."""

    @abstractmethod
    def memory(self) -> dict[str, list[dict[str, float]]]:
        """Every handle's ranks' ``memory_stats`` (peaks reset): ``{handle: [per rank]}``."""
