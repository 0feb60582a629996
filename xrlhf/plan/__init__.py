"""``xrlhf plan``: the memory and time of a config on any cluster, before anything starts.

Layers, each a module of pure functions (no Ray, nothing started, no weights read):

* ``shapes``: a model's shape from its directory's ``config.json`` alone;
* ``memory``: one engine's memory per GPU by part (weights, gradients, masters, AdamW states by
  precision and ZeRO stage, activations by token budget, vLLM's weights, graphs and KV cache);
* ``inputs``: a validated config turned into the planner's inputs;
* ``layouts``: every layout the config could take, each GPU group's memory phase by phase;
* ``sync``: the weight sync's bytes and time per transport;
* ``advise``: the change that makes a layout fit;
* ``speed``: a step's planned time, phase by phase (a roofline model, its constants in one place);
* ``search``: every way of using the cluster's GPUs (co-located or split, trainer ranks, ZeRO-3,
  vLLM's tensor and data parallel sizes), each planned, ranked by planned step time;
* ``auto``: ``layout: auto``, the fastest of them applied before a run validates;
* ``render``: the text table and the PNG.

``make_plan`` ties them together; ``xrlhf validate`` and ``xrlhf run`` use ``fit_errors``.
What is measured and what is modelled: docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xrlhf.plan.inputs import PlanInput, plan_input
from xrlhf.plan.layouts import (
    Cluster,
    LayoutPlan,
    candidate_layouts,
    configured_layout,
    gpus_asked,
    plan_layout,
)

if TYPE_CHECKING:
    from xrlhf.plan.search import Option
    from xrlhf.plan.speed import Speeds

__all__ = ["Cluster", "Plan", "fit_errors", "gpus_asked", "make_plan", "plan_input"]


@dataclass
class Plan:
    """Every layout's plan (the configured one first), and advice for the configured one;
    ``ranking``: every way of using the cluster's GPUs, fastest first (``search.search``), timed
    with ``speeds``; ``auto``: the configured layout is ``layout: auto``'s choice."""

    inp: PlanInput
    cluster: Cluster
    layouts: list[LayoutPlan]
    fix: tuple[str, LayoutPlan] | None = None
    extra: dict = field(default_factory=dict)
    ranking: list[Option] = field(default_factory=list)
    speeds: Speeds | None = None
    auto: bool = False

    @property
    def configured(self) -> LayoutPlan:
        return self.layouts[0]


def make_plan(inp: PlanInput, cluster: Cluster) -> Plan:
    """Plan every layout of ``inp`` on ``cluster``; advise when the configured one does not fit."""
    from xrlhf.plan.advise import advise

    conf = configured_layout(inp)
    plans = [plan_layout(inp, lay, cluster, configured=(i == 0)) for i, lay in enumerate(candidate_layouts(inp))]
    fix = None if plans[0].fits else advise(inp, conf, cluster)
    return Plan(inp, cluster, plans, fix)


def fit_errors(inp: PlanInput, cluster: Cluster) -> list[str]:
    """One line per reason the configured layout does not fit ``cluster`` (empty: it fits),
    with the change that would make it fit when the planner finds one."""
    plan = make_plan(inp, cluster)
    conf = plan.configured
    if conf.fits:
        return []
    how = f"; it fits with {plan.fix[0]}" if plan.fix else ""
    others = [p.layout.describe() for p in plan.layouts[1:] if p.fits]
    if not plan.fix and others:
        how = f"; the layout '{others[0]}' fits"
    return [f"plan ({conf.layout.describe()}): {line}{how} (xrlhf plan shows every phase; check_plan=false runs it anyway)" for line in conf.problems[:1]]
