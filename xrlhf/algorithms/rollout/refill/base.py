"""The refill policy's base class, its registry, and ``none`` (keep every group)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from xrlhf.algorithms.rollout.types import Group
from xrlhf.utils.registry import Registry

REFILLS: Registry[type] = Registry("refill policy", package="xrlhf.algorithms.rollout.refill", skip=("base",))

GroupFilter = Callable[[torch.Tensor], bool]
"""``scores [n] -> keep?``: the algorithm's judgement of one group (``RLTrainer.group_filter``)."""


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Refill(ABC):
    """Fills one batch of ``need`` groups over generation rounds.

    Args:
        options: the policy's validated ``Options`` (the keys of ``rollout.refill`` but ``name``).
        need: the groups a batch holds (``trainer.prompts_per_step``).
        keep: the algorithm's group filter.
    """

    Options: ClassVar[type[BaseModel]] = NoOptions
    min_samples_per_prompt: ClassVar[int] = 1
    """``trainer.samples_per_prompt`` the policy needs (checked before the run starts)."""

    def __init__(self, options: BaseModel, need: int, keep: GroupFilter):
        self.options, self.need, self.keep = options, need, keep

    @abstractmethod
    def next_round(self, kept: int, generated: int) -> int:
        """Prompts to generate in the next round, given the groups kept and generated so far (0: done)."""

    def accepts(self, group: Group) -> bool:
        """Whether the batch keeps ``group`` (else it is set aside for ``complete``)."""
        return True

    def complete(self, kept: list[Group], dropped: list[Group], generated: int) -> tuple[list[Group], dict[str, float]]:
        """The batch's groups, in order, and the policy's metrics."""
        return kept, {}


@REFILLS.register("none")
class KeepAll(Refill):
    """One round of ``need`` prompts; every group is kept."""

    def next_round(self, kept: int, generated: int) -> int:
        return self.need if generated == 0 else 0


def _split(section: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    fields = dict(section)
    return fields.pop("name", "none"), fields


def refill_errors(section: dict[str, Any]) -> list[str]:
    """Problems of a ``rollout.refill`` section (each line: the YAML path and the fix)."""
    name, fields = _split(section)
    try:
        cls = REFILLS.get(name)
    except KeyError as e:
        return [f"rollout.refill.name: {e.args[0]}"]
    if not (isinstance(cls, type) and issubclass(cls, Refill)):
        return [f"rollout.refill.name: {name!r} is not a subclass of xrlhf.algorithms.rollout.refill.Refill"]
    try:
        cls.Options(**fields)
    except ValidationError as e:
        return [f"rollout.refill.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    return []


def build_refill(section: dict[str, Any], need: int, keep: GroupFilter) -> Refill:
    """The refill policy a ``rollout.refill`` section names (validated before: ``refill_errors``)."""
    name, fields = _split(section)
    cls = REFILLS.get(name)
    return cls(cls.Options(**fields), need, keep)
