"""Placement of model handles on the Ray cluster with placement groups.

A handle either owns a placement group (one bundle per rank) or is *co-located* with another
handle (``resources.colocate_with``): then its rank ``i`` lands in bundle ``i`` of that
group, and every member of the group requests an equal share of the bundle, so Ray packs
them onto the same CPUs/GPU. This is how the co-located layout shares one GPU between the
policy trainer, its generator, the critic and the reference.

Groups are ``PACK``: a group's bundles go on as few nodes as hold them (one node when it can),
and separate groups may land on different nodes of a multi-node cluster (docs/cluster.md).
What the cluster can hold is read from its *alive* nodes, before and while a group waits to be
placed: a node that died or left (a run restarting after losing one) makes ``place`` stop at
once with one line naming what is missing, instead of waiting for a group that cannot fit. The
same holds for a handle restarted in its old group (``Slot.options``): Ray reschedules the
bundles a dead node held, and an actor asked for meanwhile would wait for them for ever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from xrlhf.config.schema import Resources
from xrlhf.coordinator.spec import anchor_of
from xrlhf.utils.errors import UserError

READY_TIMEOUT_S = 120.0
"""How long a placement group that fits the alive nodes is waited for (other jobs may hold them)."""
POLL_S = 1.0
"""How often the alive nodes are read again while a group waits."""


@dataclass
class Slot:
    """Where a handle's ranks go and what each asks Ray for."""

    pg: PlacementGroup
    bundles: int
    num_cpus: float
    num_gpus: float
    threads: int
    anchor: str = ""
    """The handle whose placement group ``pg`` is."""
    groups: dict[str, Resources] = field(default_factory=dict)
    """Every anchor handle's resources: what the cluster's alive nodes must hold."""

    def options(self, rank: int) -> dict:
        """``ray.remote(...).options(**slot.options(rank))`` for rank ``rank``.

        Waits first until the group holds all its bundles (at once, unless a node of it died and
        Ray is placing its bundles again: a handle restarted in place). Raises ``UserError`` like
        ``place`` when the alive nodes cannot hold the handles or the wait times out.
        """
        if self.groups:
            _wait_placed(self.anchor, self.groups[self.anchor], self.pg, self.groups)
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=rank % self.bundles)}


def _bundle(r: Resources) -> dict[str, float]:
    b = {"CPU": r.cpus_per_rank, "GPU": r.gpus_per_rank}
    return {k: v for k, v in b.items() if v > 0} or {"CPU": 0.01}


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in res.items())


def missing_resources(anchors: dict[str, Resources]) -> str | None:
    """Why the cluster's alive nodes cannot hold one placement group per anchor handle, as one
    line (``None``: they can, as far as totals and node sizes tell; other jobs may still hold
    some of it).

    Read from ``ray.nodes()`` each time, alive nodes only: a node that died or was removed no
    longer counts, whatever ``ray.cluster_resources()`` said a moment earlier.
    """
    nodes = ray.nodes()
    alive = [n for n in nodes if n.get("Alive")]
    lost = len(nodes) - len(alive)
    have: dict[str, float] = {}
    for n in alive:
        for k, v in n.get("Resources", {}).items():
            have[k] = have.get(k, 0.0) + v
    where = (f"the Ray cluster's {len(alive)} alive node{'s' if len(alive) != 1 else ''} "
             f"{'have' if len(alive) != 1 else 'has'}")
    gone = f" ({lost} node{'s' if lost != 1 else ''} of the cluster died or left)" if lost else ""
    for k, key in (("CPU", "cpus"), ("GPU", "gpus")):
        parts = {a: _bundle(r).get(k, 0.0) * r.ranks for a, r in anchors.items()}
        need = sum(parts.values())
        if need > have.get(k, 0.0) + 1e-9:
            by = ", ".join(f"{a} {v:g}" for a, v in parts.items() if v > 0)
            return (f"resources: the handles need {need:g} {k} in all ({by}) but {where} {have.get(k, 0.0):g}"
                    f"{gone}: {need - have.get(k, 0.0):g} {k} missing; add nodes, lower "
                    f"<handle>.resources.{key}_per_rank or ranks, or co-locate handles with resources.colocate_with")
    for a, r in anchors.items():  # a rank is one actor: its bundle must fit on one node
        b = _bundle(r)
        if not any(all(n.get("Resources", {}).get(k, 0.0) + 1e-9 >= v for k, v in b.items()) for n in alive):
            most = {k: max((n.get("Resources", {}).get(k, 0.0) for n in alive), default=0.0) for k in b}
            return (f"{a}.resources: one rank needs {_fmt(b)} on one node but no alive node has that much (the "
                    f"most one has: {_fmt(most)}){gone}; lower "
                    f"{a}.resources.cpus_per_rank / gpus_per_rank, or add a larger node")
    return None


def place(specs: dict[str, Resources], ready_timeout: float = READY_TIMEOUT_S,
          poll_s: float = POLL_S) -> dict[str, Slot]:
    """Create one placement group per anchor handle and a ``Slot`` for every handle.

    A group that is not placed at once is waited for up to ``ready_timeout`` seconds, the
    cluster's alive nodes re-read every ``poll_s``: if they can no longer hold the handles (a node
    died meanwhile) it stops then. On any failure the groups made so far are removed.

    Raises:
        UserError: when the cluster cannot hold the groups, naming the handle and the need.
    """
    anchors = {h: anchor_of(h, specs) for h in specs}
    members: dict[str, list[str]] = {}
    for h, a in anchors.items():
        members.setdefault(a, []).append(h)
    for a, group in members.items():
        for h in group:
            if specs[h].ranks > specs[a].ranks:
                raise UserError(f"{h}.resources.ranks: {specs[h].ranks} ranks cannot share the {specs[a].ranks} "
                                f"bundles of {a!r}; use at most {specs[a].ranks}")
    groups = {a: specs[a] for a in members}
    problem = missing_resources(groups)
    if problem:
        raise UserError(problem)
    slots: dict[str, Slot] = {}
    made: list[PlacementGroup] = []
    try:
        for a, group in members.items():
            r = specs[a]
            pg = placement_group([_bundle(r)] * r.ranks, strategy="PACK")
            made.append(pg)
            _wait_placed(a, r, pg, groups, ready_timeout, poll_s)
            share = 1.0 / len(group)
            for h in group:
                slots[h] = Slot(pg, r.ranks, r.cpus_per_rank * share, r.gpus_per_rank * share,
                                threads=max(1, int(specs[h].cpus_per_rank)), anchor=a, groups=groups)
    except BaseException:
        for pg in made:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - best effort: the error being raised is the one to show
                pass
        raise
    return slots


def _wait_placed(name: str, r: Resources, pg: PlacementGroup, anchors: dict[str, Resources],
                 timeout: float = READY_TIMEOUT_S, poll_s: float = POLL_S) -> None:
    ready = pg.ready()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise UserError(f"{name}.resources: Ray could not place {r.ranks} x {{{_fmt(_bundle(r))}}} within "
                            f"{timeout:g} s; free now: {_fmt(free) or 'nothing'} (other jobs or placement groups "
                            f"hold the rest)")
        done, _ = ray.wait([ready], timeout=min(poll_s, left))
        if done:
            return
        problem = missing_resources(anchors)
        if problem:
            raise UserError(problem)
