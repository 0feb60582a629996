"""Placement of model handles on the Ray cluster with placement groups.

A handle either owns a placement group (one bundle per rank) or is *co-located* with another
handle (``resources.colocate_with``): then its rank ``i`` lands in bundle ``i`` of that
group, and every member of the group requests an equal share of the bundle, so Ray packs
them onto the same CPUs/GPU. This is how the co-located layout shares one GPU between the
policy trainer, its generator, the critic and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from xrlhf.config.schema import Resources
from xrlhf.utils.errors import UserError


@dataclass
class Slot:
    """Where a handle's ranks go and what each asks Ray for."""

    pg: PlacementGroup
    bundles: int
    num_cpus: float
    num_gpus: float
    threads: int

    def options(self, rank: int) -> dict:
        """``ray.remote(...).options(**slot.options(rank))`` for rank ``rank``."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=rank % self.bundles)}


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


def _bundle(r: Resources) -> dict[str, float]:
    b = {"CPU": r.cpus_per_rank, "GPU": r.gpus_per_rank}
    return {k: v for k, v in b.items() if v > 0} or {"CPU": 0.01}


def place(specs: dict[str, Resources], ready_timeout: float = 120.0) -> dict[str, Slot]:
    """Create one placement group per anchor handle and a ``Slot`` for every handle.

    Raises:
        UserError: when the cluster cannot hold the groups, naming the handle and the need.
    """
    anchors = {h: anchor_of(h, specs) for h in specs}
    members: dict[str, list[str]] = {}
    for h, a in anchors.items():
        members.setdefault(a, []).append(h)
    total = ray.cluster_resources()
    need = {"CPU": 0.0, "GPU": 0.0}
    for a in members:
        for k, v in _bundle(specs[a]).items():
            need[k] += v * specs[a].ranks
    for k, v in need.items():
        if v > total.get(k, 0) + 1e-9:
            raise UserError(f"resources: the handles need {v:g} {k} in all but the Ray cluster has "
                            f"{total.get(k, 0):g}; lower <handle>.resources.{'cpus' if k == 'CPU' else 'gpus'}_per_rank "
                            f"or ranks, or co-locate handles with resources.colocate_with")
    slots: dict[str, Slot] = {}
    for a, group in members.items():
        r = specs[a]
        for h in group:
            if specs[h].ranks > r.ranks:
                raise UserError(f"{h}.resources.ranks: {specs[h].ranks} ranks cannot share the {r.ranks} "
                                f"bundles of {a!r}; use at most {r.ranks}")
        pg = placement_group([_bundle(r)] * r.ranks, strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=ready_timeout)
        if not ready:
            raise UserError(f"{a}.resources: Ray could not place {r.ranks} x {_bundle(r)} within "
                            f"{ready_timeout:g} s; the cluster has {total}")
        share = 1.0 / len(group)
        for h in group:
            slots[h] = Slot(pg, r.ranks, r.cpus_per_rank * share, r.gpus_per_rank * share,
                            threads=max(1, int(specs[h].cpus_per_rank)))
    return slots
