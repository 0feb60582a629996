"""A plan as text (tables in the style of the run report's memory section) and as a PNG (the
report's ``memory.png``: per phase, each handle's memory stacked, the device's total marked; here
also the GPU's capacity as a line, one panel per layout)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from xrlhf.plan import Plan
from xrlhf.plan.layouts import Group, LayoutPlan
from xrlhf.plan.memory import GIB
from xrlhf.plan.sync import LINKS, MEASURED, sync_rows
from xrlhf.utils.memory import PHASES

if TYPE_CHECKING:
    from xrlhf.plan.search import Option


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def group_table(g: Group) -> list[str]:
    """One GPU group's memory per GPU, GiB, phase by phase (markdown)."""
    lines = ["| phase | " + " | ".join(g.handles) + " | device |", "|---|" + "---|" * (len(g.handles) + 1)]
    for ph in PHASES:
        lines.append(f"| {ph} | " + " | ".join(_gib(g.alloc[(ph, n)]) for n in g.handles) + f" | {_gib(g.device(ph))} |")
    return lines


def parts_lines(g: Group) -> list[str]:
    """Each handle's memory at its peak, by part, and the token budgets."""
    out = []
    for n in g.handles:
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in g.parts.get(n, {}).items())
        budgets = "; ".join(f"{k} micro-batches of {v:,} tokens" for k, v in g.budgets.get(n, {}).items())
        out.append(f"- {n}: {parts}" + (f" ({budgets})" if budgets else ""))
    return out


def verdict(lp: LayoutPlan) -> str:
    """``fits, N GiB to spare`` or ``does not fit: why``."""
    if lp.fits:
        return f"fits, {lp.headroom() / GIB:.1f} GiB to spare on the fullest GPU"
    return "does not fit: " + lp.problems[0]


def plan_text(plan: Plan, config: str, links: dict[str, float] | None = None) -> str:
    """The whole plan as text: header, the configured layout in full (and its planned step time),
    the configured placement's variants in a line each, every way of using the GPUs ranked
    (``plan.ranking``), the weight sync, the verdict, the fix and the fastest layout's command."""
    c, inp = plan.cluster, plan.inp
    w, p = inp.workload, inp.get("policy")
    s = p.shape
    lines = [f"# xrlhf plan: {config} on {c.nodes} node(s) x {c.gpus} GPU(s) of {c.gpu_gib:g} GiB", "",
             (f"model {s.name}: {s.params / 1e9:.2f}B parameters, {s.layers} layers x {s.hidden}, vocab {s.vocab}; "
             f"step: {w.sequences} sequences of <= {w.prompt_tokens} + {w.new_tokens} tokens, "
             f"{w.mini_batch} per optimizer step"), *[f"({n})" for n in inp.notes], ""]
    conf = plan.configured
    how = "layout: auto's choice, below" if plan.auto else "as configured"
    lines += [f"## {conf.layout.describe()} ({how}): {verdict(conf)}", "", *time_lines(plan)]
    for g in conf.groups:
        lines += [(f"GPU group {'+'.join(g.handles)} ({g.gpus} GPU(s)), GiB per GPU (peak allocated per handle; device: "
                  f"every handle, caches and {g.processes} CUDA context(s)):"), "", *group_table(g), "", *parts_lines(g), ""]
    lines += [*[f"note: {n}" for n in conf.notes], *([""] if conf.notes else []),
              "## every layout of the configured placement", ""]
    lines += ["| layout | GPUs | peak phase | peak GiB/GPU | verdict |", "|---|---|---|---|---|"]
    for lp in plan.layouts:
        phase, peak = max((g.peak() for g in lp.groups), key=lambda x: x[1], default=("-", 0))
        mark = " (configured)" if lp.configured else ""
        lines.append(f"| {lp.layout.describe()}{mark} | {lp.gpus_needed} | {phase} | {_gib(peak)} | {verdict(lp)} |")
    if plan.ranking:
        lines += ["", *ranking_lines(plan)]
    lines += ["", *sync_text(plan, links), ""]
    if not conf.fits:
        lines.append("fix: " + (f"{plan.fix[0]} ({verdict(plan.fix[1])})" if plan.fix else
                                "no single change found; see the layouts above"))
    best = next((o for o in plan.ranking if o.fits), None)
    if best is not None and not plan.auto:
        same = best.plan.inp == conf.inp and best.plan.layout == conf.layout
        lines.append("fastest: the layout as configured" if same else
                     f"fastest: {shlex.join(['xrlhf', 'run', config, *best.args()])} (or layout: auto in the config)")
    return "\n".join(lines)


def time_lines(plan: Plan) -> list[str]:
    """The configured layout's planned step time, phase by phase (``plan.speed``)."""
    if plan.speeds is None:
        return []
    from xrlhf.plan.search import plan_time

    t = plan_time(plan.configured, plan.cluster, plan.speeds)
    line = (f"planned step: {t.total:.2f} s (generate {t.generate:.2f}, infer {t.infer:.2f}, train {t.train:.2f}, "
            f"sync {t.sync:.2f}; a model: xrlhf/plan/speed.py)")
    return [line, ""]


def _row(i: int, o: Option) -> str:
    """One layout of the ranking (``i``: its rank among those that fit)."""
    p, t = o.placement, o.time
    peak = max((g.peak()[1] for g in o.plan.groups), default=0) if o.plan else 0
    gens = f"{p.dp} x tp {p.tp}"
    what = o.verdict()
    times = (f"{t.total:.2f} | {t.generate:.2f} | {t.infer + t.train:.2f} | {t.sync:.2f}" if t and not o.problem
             else "- | - | - | -")
    return (f"| {i if o.fits else '-'} | {p.describe()} | {o.trainer()} | {gens} | {times} | "
            f"{_gib(peak) if peak else '-'} | {what} |")


def ranking_lines(plan: Plan, limit: int = 12) -> list[str]:
    """Every way of using the GPUs (``plan.ranking``), those that fit fastest first, as a table."""
    fits = [o for o in plan.ranking if o.fits]
    rest = [o for o in plan.ranking if not o.fits]
    shown = fits[:limit] + rest[:max(3, limit - len(fits))]
    p = plan.ranking[0].placement
    gpus = p.trainers + (p.dp * p.tp if p.split else 0)
    lines = [f"## every way of using {gpus} GPU(s), fastest first (planned s/step: xrlhf/plan/speed.py)", "",
             "| # | layout | policy | generators | s/step | generate | infer + train | sync | peak GiB/GPU | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(i + 1, o) for i, o in enumerate(shown)]
    if len(shown) < len(plan.ranking):
        lines.append(f"\n({len(plan.ranking) - len(shown)} more not shown)")
    if plan.auto:
        lines.append("\nlayout: auto: " + (f"#1, {' '.join(fits[0].args())}" if fits else "none fits"))
    return lines


def sync_text(plan: Plan, links: dict[str, float] | None = None) -> list[str]:
    """The weight sync's bytes and seconds per transport, for the configured layout."""
    conf = plan.configured
    rows = sync_rows(conf.inp, conf.layout.split, plan.cluster.gpus, links)
    out = [f"weight sync: {rows[0].bytes / GIB:.2f} GiB per generator per sync:"]
    for r in rows:
        speed = {**LINKS, **(links or {})}[r.link]
        kind = "measured" if r.link in MEASURED else "nominal"
        out.append(f"- {r.transport}{' (used)' if r.chosen else ''}: {r.seconds:.2f} s over {r.link} at "
                   f"{speed:g} GiB/s ({kind})")
    return out


def plan_png(plan: Plan, path: Path) -> Path:
    """One panel per layout: its fullest GPU group, handles stacked per phase, the device's total
    (black marks) and the GPU's capacity (red line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = [lp for lp in plan.layouts if lp.groups]
    names = list(dict.fromkeys(n for lp in layouts for g in lp.groups for n in g.handles))
    colors = {n: f"C{i}" for i, n in enumerate(names)}  # one color per handle in every panel
    fig, axes = plt.subplots(1, len(layouts), figsize=(3.2 * len(layouts), 3.6), sharey=True, squeeze=False)
    for ax, lp in zip(axes[0], layouts):
        g = max(lp.groups, key=lambda x: x.peak()[1])
        bottom = [0.0] * len(PHASES)
        for n in g.handles:
            vals = [g.alloc[(ph, n)] / GIB for ph in PHASES]
            ax.bar(PHASES, vals, bottom=bottom, label=n, width=0.6, color=colors[n])
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(PHASES, [g.device(ph) / GIB for ph in PHASES], "k_", markersize=18, mew=2)
        ax.axhline(plan.cluster.gpu_gib, color="r", lw=1)
        title = lp.layout.describe().replace(", ", "\n", 1)
        ax.set_title(title + ("\n(configured)" if lp.configured else ""), fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=45)
    axes[0][0].set_ylabel("GiB per GPU (planned)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    handles += [plt.Line2D([], [], color="k", lw=2), plt.Line2D([], [], color="r", lw=1)]
    axes[0][0].legend(handles, [*names, "device", "GPU"], fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
