"""What the coordinator is asked to build: the run's topology, decided by the shell from the config.

``Topology`` lists the handles (their engines and placement), how weights reach the generators,
and the few run options the coordinator acts on. The shell (``xrlhf/topology.py``) makes it
from the validated config; the coordinator reads nothing else, so a test or a notebook can hand
it a topology of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xrlhf.config.schema import FaultToleranceConfig, RayConfig, Resources
from xrlhf.engines.base import EngineSpec
from xrlhf.utils.errors import UserError


@dataclass
class HandleSpec:
    """One handle: its engines by role (``train`` / ``infer`` / ``generate`` -> (engine name,
    spec)) and where its ranks run."""

    name: str
    engines: dict[str, tuple[str, EngineSpec]]
    resources: Resources


@dataclass
class WeightSyncPlan:
    """How the policy's weights reach the generators.

    Attributes:
        transport: a registered transport (``auto`` already resolved).
        options: its constructor's options (shared and its own).
        colocated: the generators share the policy's bundles (each policy rank sends to the
            generator of its own bundle); else rank 0 sends to every generator.
        verify: checksums on (for the log line).
    """

    transport: str
    options: dict[str, Any]
    colocated: bool
    verify: bool = False


@dataclass
class Topology:
    """Everything the coordinator builds and wires, decided by the shell.

    Attributes:
        handles: the handles, in start order.
        weight_sync: how weights reach the generators; ``None`` when nothing generates.
        reference_from_policy: the reference is the policy's base with its LoRA adapters off
            (no handle of its own; ``BaseReference``).
        max_staleness: ``rollout.max_staleness`` (generators of a synchronous rollout hold the
            trainer's current weights: they restart in place).
        concurrent_generate: ``generate`` calls beyond the rollout's own that may run at once on
            one generator (an episode env's turns).
        ray: how to start or join Ray.
        fault_tolerance: restarts, heartbeats, collective time-outs.
    """

    handles: list[HandleSpec]
    weight_sync: WeightSyncPlan | None = None
    reference_from_policy: bool = False
    max_staleness: int = 0
    concurrent_generate: int = 0
    ray: RayConfig = field(default_factory=RayConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def spec(self, name: str) -> HandleSpec | None:
        """The handle called ``name``, or ``None``."""
        return next((s for s in self.handles if s.name == name), None)


def anchor_of(name: str, specs: dict[str, Resources]) -> str:
    """The handle whose placement group ``name`` lands in: ``colocate_with`` followed to its end.

    Raises:
        UserError: for a handle the run does not use, or a cycle.
    """
    seen = [name]
    while specs[name].colocate_with is not None:
        name = specs[name].colocate_with
        if name not in specs:
            raise UserError(f"{seen[-1]}.resources.colocate_with: handle {name!r} is not used by this run")
        if name in seen:
            raise UserError(f"{seen[0]}.resources.colocate_with: a cycle {' -> '.join(seen + [name])}")
        seen.append(name)
    return name
