"""Every layout a config could take, and each one's memory per GPU, phase by phase.

A layout is where the generators run and whether they sleep: co-located with the policy (sleep
level 2, 1 or 0; or asynchronous, awake beside the trainer) or split onto GPUs of their own
(synchronous or asynchronous). For each, the handles sharing a GPU form a group, and for each
phase of a step (``utils.memory.PHASES``) the plan gives every handle's peak allocation per GPU
(what the run's memory timeline measures as ``memory/<phase>/<handle>_gib``) and the device's
total: those peaks, what frozen engines keep cached after their forwards, and a CUDA context
per process. Token budgets left to the run are derived the way the engines derive them
(``engines.budget``), from the memory this plan says is free when they are first needed: the
infer phase for forwards, step 1's train phase (optimizer states still to come) for training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from xrlhf.plan.backends import paged, sleep_levels
from xrlhf.plan.inputs import Handle, PlanInput
from xrlhf.plan.memory import (
    CUBLAS_WORKSPACE,
    CUDA_CONTEXT,
    GIB,
    derived_tokens,
    head_working,
    infer_bytes_per_token,
    kv_tokens_held,
    train_bytes_per_token,
    trainer_state,
    vllm_asleep,
    vllm_parts,
)
from xrlhf.utils.memory import PHASES


@dataclass(frozen=True)
class Cluster:
    """The machine: ``gpus`` per node, ``nodes``, ``gpu_gib`` of memory per GPU (as torch
    reports it: a card sold as 80 GB has 79.2 GiB, the default)."""

    gpus: int = 1
    nodes: int = 1
    gpu_gib: float = 79.2

    @property
    def total_gpus(self) -> int:
        return self.gpus * self.nodes

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_gib * GIB)


@dataclass(frozen=True)
class Layout:
    """Where the generators run (``split``: on ``generator_gpus`` of their own), the sleep
    level of a co-located vLLM, and how far generation runs ahead (``staleness``)."""

    split: bool
    sleep_level: int
    staleness: int
    generator_gpus: int = 0

    def describe(self) -> str:
        mode = "async" if self.staleness else "sync"
        if self.split:
            return f"split ({self.generator_gpus} generator GPUs), {mode}"
        return f"co-located, {mode}, " + ("vLLM awake" if self.sleep_level == 0 else f"sleep level {self.sleep_level}")


@dataclass
class Group:
    """The handles of one GPU group (one placement: an anchor and what is co-located with it).

    ``alloc[(phase, handle)]``: bytes per GPU, the handle's peak allocation in the phase;
    ``cached[(phase, handle)]``: what its process keeps reserved beyond that (frozen engines'
    forward memory after the infer phase); ``parts[handle]``: its memory at its peak, by part."""

    anchor: str
    handles: list[str]
    gpus: int
    processes: int
    alloc: dict[tuple[str, str], int] = field(default_factory=dict)
    cached: dict[tuple[str, str], int] = field(default_factory=dict)
    parts: dict[str, dict[str, int]] = field(default_factory=dict)
    budgets: dict[str, dict[str, int]] = field(default_factory=dict)

    def device(self, phase: str) -> int:
        """The GPU's memory in use at the phase's peak: every handle, caches, CUDA contexts."""
        return (sum(v for (p, _), v in self.alloc.items() if p == phase)
                + sum(v for (p, _), v in self.cached.items() if p == phase) + self.processes * CUDA_CONTEXT)

    def peak(self) -> tuple[str, int]:
        return max(((p, self.device(p)) for p in PHASES), key=lambda x: x[1])


@dataclass
class LayoutPlan:
    """One layout's plan: its groups, the GPUs it needs, and why it does not fit (empty: it fits)."""

    layout: Layout
    groups: list[Group]
    gpus_needed: int
    cluster: Cluster
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    configured: bool = False
    inp: PlanInput | None = None

    @property
    def fits(self) -> bool:
        return not self.problems

    def headroom(self) -> int:
        """The smallest free memory of any GPU at its peak phase (negative: over by that much)."""
        return min((self.cluster.gpu_bytes - g.peak()[1] for g in self.groups), default=self.cluster.gpu_bytes)


def configured_layout(inp: PlanInput) -> Layout:
    """The layout ``inp`` describes as written."""
    r, p = inp.get("rollout"), inp.get("policy")
    split = r.anchor != p.anchor
    return Layout(split, r.generator.sleep_level, inp.staleness, r.ranks * max(1, math.ceil(r.gpus)) if split else 0)


def gpus_asked(inp: PlanInput) -> int:
    """GPUs the configured layout places handles on (one node of that many by default)."""
    return max(1, plan_layout(inp, configured_layout(inp), Cluster(1 << 16)).gpus_needed)


def apply_layout(inp: PlanInput, layout: Layout) -> PlanInput:
    """``inp`` with its generators placed as ``layout`` says."""
    r, p = inp.get("rollout"), inp.get("policy")
    g = replace(r.generator, sleep_level=layout.sleep_level if not layout.split else r.generator.sleep_level)
    if layout.split:
        tp = r.generator.tp
        r = replace(r, anchor="rollout", ranks=max(1, layout.generator_gpus // tp), gpus=float(tp), generator=g)
    else:
        r = replace(r, anchor=p.anchor, ranks=p.ranks, gpus=p.gpus, generator=g)
    return replace(inp.with_handle(r), staleness=layout.staleness)


def candidate_layouts(inp: PlanInput) -> list[Layout]:
    """The configured layout first, then every other one the config could take."""
    conf = configured_layout(inp)
    p, r = inp.get("policy"), inp.get("rollout")
    lag = max(1, inp.staleness)
    split_gpus = conf.generator_gpus or max(r.generator.tp, p.ranks * max(1, math.ceil(p.gpus)))
    out = [conf]
    out += [Layout(False, s, 0) for s in sleep_levels(r.generator.engine)]
    out += [Layout(False, 0, lag), Layout(True, conf.sleep_level, 0, split_gpus), Layout(True, conf.sleep_level, lag,
                                                                                        split_gpus)]
    seen, unique = set(), []
    for lay in out:
        key = (lay.split, 0 if lay.split else lay.sleep_level, bool(lay.staleness), lay.generator_gpus)
        if key not in seen:
            seen.add(key)
            unique.append(lay)
    return unique


def plan_layout(inp: PlanInput, layout: Layout, cluster: Cluster, configured: bool = False) -> LayoutPlan:
    """The memory of every GPU group of ``inp`` placed as ``layout`` on ``cluster``."""
    inp = apply_layout(inp, layout)
    anchors = list(dict.fromkeys(h.anchor for h in inp.handles))
    groups, cpu = [], []
    for a in anchors:
        members = [h for h in inp.handles if h.anchor == a]
        head = inp.get(a)
        if head.gpus <= 0:
            cpu += [h.name for h in members]
            continue
        gpus = max(1, math.ceil(head.ranks * head.gpus))
        processes = sum(max(1, round(h.ranks / gpus)) for h in members) + sum(h.generator is not None for h in members)
        groups.append(_group(inp, layout, cluster, a, members, gpus, processes))
    plan = LayoutPlan(layout, groups, sum(g.gpus for g in groups), cluster, configured=configured, inp=inp)
    if cpu:
        plan.notes.append(f"on CPU (not planned): {', '.join(cpu)}")
    _check(plan, inp)
    return plan


def _group(inp: PlanInput, layout: Layout, cluster: Cluster, anchor: str, members: list[Handle], gpus: int,
           processes: int) -> Group:
    """Fill one group phase by phase: generators and fixed state first, then derived budgets."""
    g = Group(anchor, [h.name for h in members], gpus, processes)
    awake_always = layout.split or layout.staleness > 0
    for h in members:
        if h.generator is not None:
            _generator_phases(g, h, cluster, awake_always)
        elif h.frozen is not None:
            _frozen_phases(g, h, inp, cluster)
        else:
            _trainer_resident(g, h, inp)
    trainers = [h for h in members if h.trainer is not None]
    for h in trainers:
        _trainer_infer(g, h, inp, cluster)
    for h in trainers:
        _trainer_train(g, h, inp, cluster, share=1.0 / len(trainers))
    return g


def _generator_phases(g: Group, h: Handle, cluster: Cluster, awake_always: bool) -> None:
    awake = vllm_parts(h.shape, h.generator, cluster.gpu_bytes)
    level = 0 if awake_always or max(sleep_levels(h.generator.engine)) == 0 else h.generator.sleep_level
    asleep = vllm_asleep(awake, level)
    # The sync wakes the weights, receives them, then wakes the KV cache once the trainer has
    # returned its cache (coordinator.weight_routes): by the phase's end the generator is awake
    # (measured: the device at the sync's end holds what it held while generating).
    for phase, parts in (("generate", awake), ("sleep", asleep), ("infer", asleep), ("train", asleep),
                         ("sync", awake)):
        g.alloc[(phase, h.name)] = sum(parts.values())
    g.parts[h.name] = awake


def _frozen_phases(g: Group, h: Handle, inp: PlanInput, cluster: Cluster) -> None:
    f = h.frozen
    params = h.shape.head_params(f.head)
    weights = params * f.dtype_bytes // (f.ranks if f.zero_stage == 3 else 1)
    for phase in PHASES:
        g.alloc[(phase, h.name)] = weights + CUBLAS_WORKSPACE
    per_token = infer_bytes_per_token(h.shape, None, f.dtype_bytes, f.head, f.chunk, f.compiled)
    fixed = head_working(h.shape, f.head, f.chunk, training=False)
    free = cluster.gpu_bytes - g.device("infer") - CUDA_CONTEXT * 0
    budget_tokens = f.tokens or derived_tokens(free, 0, fixed, per_token, 1.0, infer=True)
    act = _used(budget_tokens, f.rows, inp, h.ranks) * per_token + fixed
    g.alloc[("infer", h.name)] = weights + CUBLAS_WORKSPACE + act
    for phase in PHASES:
        if phase != "infer":
            g.cached[(phase, h.name)] = act
    g.budgets[h.name] = {"infer": budget_tokens}
    g.parts[h.name] = {"weights": weights, "cuBLAS workspace": CUBLAS_WORKSPACE, "activations": act}


def _used(budget: int, rows: int, inp: PlanInput, ranks: int, mini: bool = False) -> int:
    """Tokens of the largest micro-batch. A rank's batch (or mini-batch, for training) is split
    into the fewest micro-batches within the budget and ``rows`` rows, balanced by tokens
    (``data.micro_batches.plan_micro_batches``): each holds about the total over their count, a
    sequence more at most, never more than the budget (e.g. 145k tokens under a 61k budget make 3
    micro-batches of up to 48.5k: docs/plan.md)."""
    w = inp.workload
    seqs = math.ceil((w.mini_batch if mini else w.sequences) / max(ranks, 1))
    total = seqs * w.seq_len
    count = math.ceil(total / max(budget, 1))
    if rows:
        count = max(count, math.ceil(seqs / rows))
    return max(min(budget, math.ceil(total / count) + w.seq_len), min(w.seq_len, total))


def _trainer_resident(g: Group, h: Handle, inp: PlanInput) -> None:
    state = sum(trainer_state(h.shape, h.trainer).values()) + CUBLAS_WORKSPACE
    for phase in PHASES:
        g.alloc[(phase, h.name)] = state
    if h.name == "policy":
        g.alloc[("sync", h.name)] = state + inp.bucket_bytes


def _trainer_infer(g: Group, h: Handle, inp: PlanInput, cluster: Cluster) -> None:
    """The forward without gradients: the policy's old logprobs (unless skipped), the critic's values."""
    t = h.trainer
    if h.name == "policy" and not inp.workload.old_logprobs:
        return
    per_token = infer_bytes_per_token(h.shape, t)
    fixed = head_working(h.shape, t.head, t.chunk, training=False)
    free = cluster.gpu_bytes - g.device("infer")
    budget_tokens = t.infer_tokens or derived_tokens(free, 0, fixed, per_token, 1.0, infer=True)
    g.alloc[("infer", h.name)] += _used(budget_tokens, t.rows, inp, h.ranks) * per_token + fixed
    g.budgets.setdefault(h.name, {})["infer"] = budget_tokens


def _trainer_train(g: Group, h: Handle, inp: PlanInput, cluster: Cluster, share: float) -> None:
    """The train phase: the budget derived at step 1 (AdamW's states pending), then the peak."""
    t = h.trainer
    first = sum(trainer_state(h.shape, t, stepped=False).values())
    state = trainer_state(h.shape, t)
    pending = sum(state.values()) - first
    per_token = train_bytes_per_token(h.shape, t)  # what the engine derives with
    fixed = head_working(h.shape, t.head, t.chunk, training=True)
    others = g.device("train") - g.alloc[("train", h.name)]
    if share < 1.0:  # the other trainers' activations are not allocated yet when each derives
        others -= sum(g.alloc[("train", n)] - g.alloc[("sleep", n)] for n in g.handles if n != h.name
                      and ("train", n) in g.alloc)
    budget_tokens = t.tokens or derived_tokens(cluster.gpu_bytes - others - first, pending, fixed, per_token, share,
                                               False)
    act = _used(budget_tokens, t.rows, inp, h.ranks, mini=True) * per_token + fixed
    g.alloc[("train", h.name)] = sum(state.values()) + CUBLAS_WORKSPACE + act
    g.budgets.setdefault(h.name, {})["train"] = budget_tokens
    g.parts[h.name] = {**state, "cuBLAS workspace": CUBLAS_WORKSPACE, "activations": act}


def _check(plan: LayoutPlan, inp: PlanInput) -> None:
    """Why the layout does not fit (``plan.problems``), and what is worth knowing (``notes``)."""
    c = plan.cluster
    gen = inp.get("rollout").generator
    if not plan.layout.split and gen.tp > 1:
        plan.problems.append(f"generate: rollout: tensor_parallel_size {gen.tp} needs the split layout (a co-located "
                             f"generator has one GPU: its policy rank's)")
    if plan.gpus_needed > c.total_gpus:
        plan.problems.append(f"needs {plan.gpus_needed} GPUs, the cluster has {c.total_gpus}")
    for g in plan.groups:
        phase, peak = g.peak()
        if peak > c.gpu_bytes:
            name, top = max(((n, g.alloc[(phase, n)]) for n in g.handles), key=lambda x: x[1])
            plan.problems.append(f"{phase}: the GPUs of {'+'.join(g.handles)} need {peak / GIB:.1f} GiB of "
                                 f"{c.gpu_gib:.1f} GiB (over by {(peak - c.gpu_bytes) / GIB:.1f}); {name} holds "
                                 f"{top / GIB:.1f} GiB")
        for n in g.handles:
            h = inp.get(n)
            if h.generator is not None and paged(h.generator):
                _vllm_checks(plan, g, h)


def _vllm_checks(plan: LayoutPlan, g: Group, h: Handle) -> None:
    gen, c = h.generator, plan.cluster
    parts = g.parts[h.name]
    if gen.kv_tokens is None and parts["kv cache"] <= 0:
        plan.problems.append(f"generate: rollout: gpu_memory_utilization {gen.gpu_memory_utilization:g} x "
                             f"{c.gpu_gib:.1f} GiB leaves no KV cache after vLLM's weights and activations "
                             f"({(parts['weights'] + parts['activations']) / GIB:.1f} GiB)")
    if gen.kv_tokens is None and len(g.handles) > 1:  # vLLM checks that its share is free when it starts
        before = sum(g.alloc[("sleep", n)] for n in g.handles if n != h.name) + g.processes * CUDA_CONTEXT
        if before + gen.gpu_memory_utilization * c.gpu_bytes > c.gpu_bytes:
            plan.problems.append(f"generate: rollout: vLLM starts only with gpu_memory_utilization "
                                 f"{gen.gpu_memory_utilization:g} x {c.gpu_gib:.1f} GiB free, but the handles beside "
                                 f"it hold {before / GIB:.1f} GiB")
    held = kv_tokens_held(h.shape, gen, parts)
    need = math.ceil(plan.inp.workload.sequences / max(h.ranks, 1)) * plan.inp.workload.seq_len
    if 0 < held < need:
        plan.notes.append(f"rollout: the KV cache holds {held:,} tokens of the {need:,} a generator's batch may "
                          f"reach: vLLM runs it in waves (fits, slower)")
