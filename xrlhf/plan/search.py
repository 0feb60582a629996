"""Every way of using the cluster's GPUs, each planned in full and ranked by its step time.

Why: a config names one layout (say, one GPU, co-located); the machine may have four. Here every
layout that uses all the GPUs the policy and its generators may take is written as the overrides
that make it (``key=value``, as ``xrlhf run`` takes them), the config is validated with them,
planned (``plan.layouts``) and timed (``plan.speed``):

* co-located: every GPU holds a policy rank and its generator (``tensor_parallel_size`` 1, as
  the vLLM engine's ``placement_errors`` require), synchronous with vLLM asleep while training
  (sleep level 2), or one step off with vLLM awake;
* split, one step off: ``dp`` generators of ``tp`` GPUs each (``tp`` a power of two dividing the
  attention heads, within a node) and the policy on the rest.

Handles co-located with the policy (reference, critic, reward, teacher) get as many ranks. Each
layout tries its trainers as configured, then ZeRO-3 (DeepSpeed; the project has no FSDP
engine), then the reference ZeRO-3 too, and where vLLM sizes its KV cache by
``gpu_memory_utilization``, lower values until one fits; the fastest way that fits is the
layout's. ``keep``: a config's own values (``layout: auto``): a layout that would change one is
not chosen, and says which.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from xrlhf.plan.backends import backend, shard_overrides, yaml_value
from xrlhf.plan.layouts import Cluster, LayoutPlan, configured_layout, plan_layout
from xrlhf.plan.speed import Speeds, StepTime, kv_held_of, step_time
from xrlhf.plan.sync import sync_rows
from xrlhf.utils.errors import UserError

_MISSING = object()


@dataclass(frozen=True)
class Placement:
    """Where the policy and its generators go: ``trainers`` GPUs (one rank each) and ``dp``
    generators of ``tp`` GPUs (co-located: one per policy rank, on its GPU)."""

    split: bool
    trainers: int
    dp: int
    tp: int = 1
    staleness: int = 0

    def describe(self) -> str:
        mode = "one step off" if self.staleness == 1 else (f"{self.staleness} steps off" if self.staleness else "sync")
        return f"{'split' if self.split else 'co-located'}, {mode}"


@dataclass
class Option:
    """One layout: its overrides, its plan and planned time, and why it does not fit (empty: it
    fits); ``note``: what it took to fit (a lower ``gpu_memory_utilization``)."""

    placement: Placement
    overrides: dict[str, Any] = field(default_factory=dict)
    plan: LayoutPlan | None = None
    time: StepTime | None = None
    problem: str = ""
    note: str = ""
    clash: list[str] = field(default_factory=list)
    """The config's own values it would change (``keep``): not chosen, whether it fits or not."""

    @property
    def fits(self) -> bool:
        return not self.problem and not self.clash

    def verdict(self) -> str:
        """``fits, N GiB to spare``, ``does not fit: why`` or ``not chosen: changes ...``."""
        if self.problem:
            return "does not fit: " + self.problem
        if self.clash:
            return "not chosen: changes " + ", ".join(self.clash)
        return f"fits, {self.plan.headroom() / 2**30:.1f} GiB to spare" + (f"; {self.note}" if self.note else "")

    def args(self) -> list[str]:
        """The overrides as ``xrlhf run`` takes them."""
        return [f"{k}={yaml_value(v)}" for k, v in self.overrides.items()]

    def trainer(self) -> str:
        """The policy's ranks and sharding, e.g. ``3 x ZeRO-3``."""
        t = self.plan.inp.get("policy").trainer if self.plan else None
        if t is None:
            return f"{self.placement.trainers}"
        how = f"ZeRO-{t.zero_stage}" if backend(t.engine, "train").memory_model == "zero" else t.engine
        ref = self.plan.inp.get("reference")
        if ref is not None and ref.frozen is not None and ref.frozen.zero_stage == 3:
            how += ", ref ZeRO-3"
        return f"{self.placement.trainers} x {how}"


def written(data: dict, key: str) -> Any:
    """The value ``data`` sets at dotted ``key`` (``_MISSING`` where it sets none; ``None``
    where a section on the way is written as null)."""
    node: Any = data
    for part in key.split("."):
        if node is None:
            return None
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def conflicts(keep: dict, overrides: dict[str, Any]) -> list[str]:
    """The overrides that would change a value ``keep`` sets, as ``key (value in the config)``."""
    out = []
    for k, v in overrides.items():
        w = written(keep, k)
        if w is not _MISSING and w != v and not (isinstance(w, dict) and v is not None):
            out.append(f"{k} ({yaml_value(w) if not isinstance(w, dict) else 'a section'} in the config)")
    return out


def placements(pool: int, per_node: int, heads: int, staleness: int, tp_ok: bool = True) -> list[Placement]:
    """Every placement of the policy and its generators on ``pool`` GPUs (``per_node`` a node)."""
    lag = max(1, staleness)
    out = [Placement(False, pool, pool), Placement(False, pool, pool, staleness=lag)]
    sizes = [tp for tp in (1, 2, 4, 8, 16) if tp <= per_node and (not heads or heads % tp == 0)] if tp_ok else [1]
    for tp in sizes:
        for dp in range(1, (pool - 1) // tp + 1):
            out.append(Placement(True, pool - tp * dp, dp, tp, lag))
    return out


def placement_overrides(cfg, p: Placement, total_gpus: int) -> dict[str, Any]:
    """The overrides that place ``cfg``'s handles as ``p`` says."""
    from xrlhf.coordinator.spec import anchor_of
    from xrlhf.topology import placements as placed_of

    gen = backend(cfg.policy.generate.engine, "generate")
    o: dict[str, Any] = {"policy.resources.ranks": p.trainers, "policy.resources.gpus_per_rank": 1}
    if p.split:
        o.update({"policy.generate.resources.ranks": p.dp, "policy.generate.resources.gpus_per_rank": p.tp})
    else:
        o["policy.generate.resources"] = None
    if gen.tensor_parallel:
        o["policy.generate.tensor_parallel_size"] = p.tp
    if max(gen.sleep_levels) > 0:  # asleep while training when synchronous and co-located: the deepest
        asleep = 1 if _adapter_sync(cfg) else gen.sleep_levels[0]  # level, or 1 to keep the base for an adapter
        o["policy.generate.sleep_level"] = asleep if not p.split and not p.staleness else 0
    o["rollout.max_staleness"] = p.staleness
    placed = placed_of(cfg)
    for h in ("critic", "reference", "reward", "teacher"):
        if h in placed and anchor_of(h, placed) == "policy":
            o[f"{h}.resources.ranks"] = p.trainers
            o[f"{h}.resources.colocate_with"] = placed[h].colocate_with
    if cfg.ray.num_gpus is not None and cfg.ray.address is None and cfg.ray.num_gpus != total_gpus:
        o["ray.num_gpus"] = total_gpus
    return o


def _adapter_sync(cfg) -> bool:
    """Whether the syncs carry the policy's LoRA adapter alone (vLLM must keep its base weights)."""
    from xrlhf.topology import policy_adapter

    adapter = policy_adapter(cfg)
    return adapter is not None and adapter.sync == "adapter"


def sharding_steps(cfg, p: Placement) -> list[dict[str, Any]]:
    """The trainers' sharding, least change first: as configured, ZeRO-3, the reference ZeRO-3 too."""
    from xrlhf.coordinator.spec import anchor_of
    from xrlhf.topology import placements as placed_of

    steps: list[dict[str, Any]] = [{}]
    if p.trainers < 2:
        return steps
    placed = placed_of(cfg)
    zero = shard_overrides("policy.train", cfg.policy.train.engine, "train", 3)
    if zero and "critic" in placed and anchor_of("critic", placed) == "policy":
        zero.update(shard_overrides("critic.train", cfg.critic.train.engine, "train", 3))
    if zero:
        steps.append(zero)
    if zero and "reference" in placed and anchor_of("reference", placed) == "policy":
        steps.append({**zero, **shard_overrides("reference.infer", cfg.reference.infer.engine, "infer", 3)})
    return steps


def layout_errors(cfg) -> list[str]:
    """What the generate engine and the weight sync say of the layout (``xrlhf validate``'s checks
    of placement, rollout mode and transport), without their packages."""
    from xrlhf.engines.base import engine_class, engine_options
    from xrlhf.engines.spec import RolloutPlan
    from xrlhf.topology import colocated, on_gpu
    from xrlhf.topology import placements as placed_of
    from xrlhf.weight_sync import transport_errors

    g = cfg.policy.generate
    split = g.resources is not None
    cls = engine_class(g.engine, "generate")
    options = engine_options(g.engine, "generate", g.engine_fields(), "policy.generate")
    res = g.resources if split else cfg.policy.resources
    errors = cls.placement_errors(options, "policy.generate.resources" if split else "policy.resources",
                                  res.gpus_per_rank, split)
    errors += cls.rollout_errors(options, cfg.rollout, RolloutPlan(split))
    if _adapter_sync(cfg):
        from xrlhf.topology import policy_adapter

        errors += cls.adapter_errors(options, policy_adapter(cfg))
    ws, placed = cfg.policy.weight_sync, placed_of(cfg)
    gpu = on_gpu(placed, "policy") and on_gpu(placed, "rollout")
    return errors + transport_errors(ws.transport, ws.transport_options(), colocated(cfg), gpu)


def _validated(data: dict, args: list[str]):
    from xrlhf.config.loader import apply_overrides, format_errors
    from xrlhf.config.schema import XConfig

    try:
        return XConfig.model_validate(apply_overrides(copy.deepcopy(data), args)), ""
    except ValidationError as e:
        return None, format_errors(e, XConfig)[0]
    except UserError as e:
        return None, e.messages[0]


def plan_time(lp: LayoutPlan, cluster: Cluster, speeds: Speeds) -> StepTime:
    """The planned step time of a layout's plan (its generators' KV cache from the plan, its
    weight sync by the transport the run would use)."""
    rollout = next((g.parts.get("rollout") for g in lp.groups if "rollout" in g.handles), None)
    rows = sync_rows(lp.inp, lp.layout.split, cluster.gpus)
    sync = next((r.seconds for r in rows if r.chosen), rows[0].seconds)
    return step_time(lp.inp, lp.layout.split, kv_held_of(lp.inp, rollout), sync, speeds)


def plan_option(data: dict, cfg, p: Placement, extra: dict[str, Any], cluster: Cluster, speeds: Speeds,
                prompt_tokens: int) -> Option:
    """``p`` with the sharding ``extra``: validated, planned, and where vLLM's share is what does
    not fit, planned again with lower ``gpu_memory_utilization`` (the largest that fits)."""
    from xrlhf.plan.advise import lower_utilization
    from xrlhf.plan.inputs import plan_input

    o = Option(p, {**placement_overrides(cfg, p, cluster.total_gpus), **extra})
    new, o.problem = _validated(data, o.args())
    if new is None:
        return o
    try:
        inp = plan_input(new, prompt_tokens)
        errors = layout_errors(new)
    except (UserError, KeyError, ValidationError) as e:
        o.problem = e.messages[0] if isinstance(e, UserError) else str(e).splitlines()[0]
        return o
    if errors:
        o.problem = errors[0]
        return o
    layout = configured_layout(inp)
    o.plan = plan_layout(inp, layout, cluster)
    if not o.plan.fits:
        for override, changed in lower_utilization(inp):
            lp = plan_layout(changed, layout, cluster)
            if lp.fits:
                key, _, value = override.partition("=")
                o.overrides[key], o.plan = float(value), lp
                o.note = f"fits with {override} (configured {inp.get('rollout').generator.gpu_memory_utilization:g})"
                break
    o.problem = "" if o.plan.fits else o.plan.problems[0]
    o.time = plan_time(o.plan, cluster, speeds)
    return o


def _pool(cfg, cluster: Cluster) -> int:
    """GPUs left to the policy and its generators: the cluster's less those of handles placed on
    GPUs of their own (a reward model's, say), which keep them."""
    from xrlhf.coordinator.spec import anchor_of
    from xrlhf.topology import placements as placed_of

    placed = placed_of(cfg)
    own = sum(math.ceil(r.ranks * r.gpus_per_rank) for h, r in placed.items()
              if h not in ("policy", "rollout") and anchor_of(h, placed) == h)
    return cluster.total_gpus - own


def search(data: dict, cluster: Cluster, speeds: Speeds, prompt_tokens: int = 64,
           keep: dict | None = None) -> list[Option]:
    """Every layout of config dict ``data`` on ``cluster``, those that fit first, fastest first
    (``_rank``). ``keep``: values no layout may change (those that would are listed as not
    chosen, naming the value)."""
    from xrlhf.plan.shapes import model_shape

    cfg, problem = _validated(data, [])
    if cfg is None:
        raise UserError(problem)
    pool = _pool(cfg, cluster)
    if pool < 1:
        return []
    heads = model_shape(cfg.policy.model).heads
    options = []
    tp_ok = backend(cfg.policy.generate.engine, "generate").tensor_parallel
    for p in placements(pool, cluster.gpus, heads, cfg.rollout.max_staleness, tp_ok):
        tried = []
        for extra in sharding_steps(cfg, p):
            o = plan_option(data, cfg, p, extra, cluster, speeds, prompt_tokens)
            o.clash = conflicts(keep, o.overrides) if keep is not None else []
            tried.append(o)
        fit = [o for o in tried if o.fits]
        options.append(min(fit, key=lambda o: o.time.total) if fit else _closest(tried))
    return sorted(options, key=_rank)


def _closest(tried: list[Option]) -> Option:
    """Of a placement's ways not chosen, the one to show: the first that fits but changes a kept
    value, else the last planned (the most sharded)."""
    fit = [o for o in tried if not o.problem and o.time is not None]
    planned = [o for o in tried if o.plan is not None]
    return fit[0] if fit else planned[-1] if planned else tried[0]


def _rank(o: Option) -> tuple:
    """Those that fit, fastest first (then the faster generation, then fewer overrides); then
    those that fit but are not chosen; then those that do not fit."""
    timed = o.time is not None and not o.problem
    return (not o.fits, not timed, o.time.total if timed else 0.0, o.time.generate if timed else 0.0,
            len(o.overrides))
