"""A plan as text (tables in the style of the run report's memory section) and as a PNG (the
report's ``memory.png``: per phase, each handle's memory stacked, the device's total marked; here
also the GPU's capacity as a line, one panel per layout)."""

from __future__ import annotations

from pathlib import Path

from xrlhf.plan import Plan
from xrlhf.plan.layouts import Group, LayoutPlan
from xrlhf.plan.memory import GIB
from xrlhf.plan.sync import LINKS, MEASURED, sync_rows
from xrlhf.utils.memory import PHASES


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
    """The whole plan as text: header, the configured layout in full, the others in a line each,
    the weight sync, the verdict and the fix."""
    c, inp = plan.cluster, plan.inp
    w, p = inp.workload, inp.get("policy")
    s = p.shape
    lines = [f"# xrlhf plan: {config} on {c.nodes} node(s) x {c.gpus} GPU(s) of {c.gpu_gib:g} GiB", "",
             (f"model {s.name}: {s.params / 1e9:.2f}B parameters, {s.layers} layers x {s.hidden}, vocab {s.vocab}; "
             f"step: {w.sequences} sequences of <= {w.prompt_tokens} + {w.new_tokens} tokens, "
             f"{w.mini_batch} per optimizer step"), *[f"({n})" for n in inp.notes], ""]
    conf = plan.configured
    lines += [f"## {conf.layout.describe()} (as configured): {verdict(conf)}", ""]
    for g in conf.groups:
        lines += [(f"GPU group {'+'.join(g.handles)} ({g.gpus} GPU(s)), GiB per GPU (peak allocated per handle; device: "
                  f"every handle, caches and {g.processes} CUDA context(s)):"), "", *group_table(g), "", *parts_lines(g), ""]
    lines += [*[f"note: {n}" for n in conf.notes], *([""] if conf.notes else []), "## every layout", ""]
    lines += ["| layout | GPUs | peak phase | peak GiB/GPU | verdict |", "|---|---|---|---|---|"]
    for lp in plan.layouts:
        phase, peak = max((g.peak() for g in lp.groups), key=lambda x: x[1], default=("-", 0))
        mark = " (configured)" if lp.configured else ""
        lines.append(f"| {lp.layout.describe()}{mark} | {lp.gpus_needed} | {phase} | {_gib(peak)} | {verdict(lp)} |")
    lines += ["", *sync_text(plan, links), ""]
    if not conf.fits:
        lines.append("fix: " + (f"{plan.fix[0]} ({verdict(plan.fix[1])})" if plan.fix else
                                "no single change found; see the layouts above"))
    return "\n".join(lines)


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
