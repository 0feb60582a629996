"""``report.md`` and PNG plots of a run, from ``metrics.jsonl`` alone.

Works for a finished or an interrupted run: ``xrlhf report RUN_DIR`` regenerates it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xrlhf.utils.errors import UserError

PHASES = ["time/generate_s", "time/reward_s", "time/infer_s", "time/train_s", "time/sync_s"]
"""Phases of a step (with an asynchronous rollout generate and reward overlap the others:
``plots/timeline.png`` shows how)."""
PLOTS: dict[str, tuple[str, list[str]]] = {
    "reward": ("reward (train samples) and eval reward (held out)", ["reward/mean", "eval/reward_mean"]),
    "kl": ("KL(policy || reference), nats per sequence", ["kl/mean"]),
    "losses": ("losses", ["policy/loss", "critic/loss"]),
    "throughput": ("generated tokens per second", ["perf/gen_tokens_per_s"]),
}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(path.read_text().splitlines()):  # a torn last line is a crash, not an error
                    raise UserError(f"{path}:{i}: not valid JSON") from None
    return rows


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if "step" in r and isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def make_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """One PNG per plot with data; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, keys) in PLOTS.items():
        lines = [(k, *series(rows, k)) for k in keys]
        lines = [ln for ln in lines if ln[1]]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for key, xs, ys in lines:
            ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, label=key)
        ax.set(title=title, xlabel="RL step")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        written.append(out / f"{name}.png")
    phases = [(k, *series(rows, k)) for k in PHASES]
    phases = [p for p in phases if p[1]]
    if phases:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        steps = phases[0][1]
        bottom = [0.0] * len(steps)
        for key, xs, ys in phases:
            by_step = dict(zip(xs, ys))
            vals = [by_step.get(s, 0.0) for s in steps]
            ax.bar(steps, vals, bottom=bottom, label=key.split("/")[1][:-2], width=1.0)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set(title="seconds per phase of each RL step", xlabel="RL step", ylabel="s")
        ax.legend(ncol=len(phases), fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "phases.png", dpi=110)
        plt.close(fig)
        written.append(out / "phases.png")
    return written


LANE_COLORS = {"infer": "tab:orange", "train": "tab:red", "sync": "tab:purple", "wait": "0.85", "update": "0.6"}


def make_timeline(rows: list[dict[str, Any]], out: Path, last: int = 4) -> Path | None:
    """``timeline.png``: what ran when on each lane (trainer, generator, reward) over the last
    ``last`` steps (each step's ``timeline`` spans, ``utils.timeline``); None without spans."""
    steps = [r for r in rows if r.get("timeline") and "reward/mean" in r][-last:]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [s for r in steps for s in r["timeline"]]
    lanes = [lane for lane in ("trainer", "generator", "reward") if any(s[0] == lane for s in spans)]
    lanes += sorted({s[0] for s in spans} - set(lanes))
    t0 = min(s[2] for s in spans)
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.7 * len(lanes)))
    for order in (0, 1):  # the trainer's whole 'update' first, its parts on top
        for lane, name, start, end in spans:
            if (name == "update") != (order == 0):
                continue
            y = lanes.index(lane)
            color = LANE_COLORS.get(name, "tab:blue" if lane == "generator" else "tab:green")
            ax.barh(y, end - start, left=start - t0, height=0.6, color=color, edgecolor="white", linewidth=0.5)
            if end - start > 0.04 * (max(s[3] for s in spans) - t0):
                ax.text((start + end) / 2 - t0, y, name, ha="center", va="center", fontsize=7)
    for r in steps:  # where each step ended
        ends = [s[3] for s in r["timeline"] if s[0] == "trainer"]
        if ends:
            ax.axvline(max(ends) - t0, color="0.5", lw=0.6, ls=":")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set(title=f"timeline of steps {steps[0]['step']}-{steps[-1]['step']} (dotted: a step ends)", xlabel="s")
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_memory(rows: list[dict[str, Any]], out: Path) -> tuple[Path | None, list[str]]:
    """``memory.png`` and a markdown table: each phase's memory by handle, mean over the steps
    (``utils.memory``); ``(None, [])`` without ``memory/`` metrics."""
    from xrlhf.utils.memory import memory_table

    phases, names, means = memory_table(rows)
    if not phases:
        return None, []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = "device" in names
    what = "peak allocated per process" if gpu else "resident set per process at the phase's end"
    table = [f"Memory by phase, GiB, mean over the steps ({what}"
             + ("; device: in use at the phase's end, every process" if gpu else "") + "):", "",
             "| phase | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for ph in phases:
        table.append(f"| {ph} | " + " | ".join(f"{means[(ph, n)]:.2f}" if (ph, n) in means else "—" for n in names)
                     + " |")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(phases)
    for n in [n for n in names if n != "device"]:
        vals = [means.get((ph, n), 0.0) for ph in phases]
        ax.bar(phases, vals, bottom=bottom, label=n, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if gpu:
        ax.plot(phases, [means.get((ph, "device"), float("nan")) for ph in phases], "k_", markersize=30, mew=2,
                label="device in use")
    ax.set(title=f"memory by phase ({what})", ylabel="GiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, table + [""]


def write_report(run_dir: str | Path) -> Path:
    """Write ``report.md`` and ``plots/*.png`` for ``run_dir``; returns the report's path."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    plots = make_plots(rows, run_dir / "plots")
    timeline = make_timeline(rows, run_dir / "plots")
    plots += [timeline] if timeline is not None else []
    memory_png, memory_lines = make_memory(rows, run_dir / "plots")
    plots += [memory_png] if memory_png is not None else []
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    steps = [r for r in rows if "step" in r and isinstance(r.get("reward/mean"), (int, float))]
    lines = [f"# Run report: {run_dir.name}", ""]
    if summary is None:
        lines += ["**Interrupted run** (no summary.json): figures up to the last logged step.", ""]
    else:
        lines += ["| | |", "|---|---|"]
        for key in ("steps", "wall_seconds", "eval_reward_before_warmup", "eval_reward_initial", "eval_reward_final",
                    "final_checkpoint"):
            if key in summary:
                lines.append(f"| {key} | {summary[key]} |")
        lines.append("")
    if steps:
        last = steps[-1]
        mean_phase = {k: sum(r.get(k) or 0.0 for r in steps) / len(steps) for k in PHASES}
        lines += [f"Last logged step: {last['step']}; train reward {last['reward/mean']:.3f}.", "",
                  "Mean seconds per phase: " + ", ".join(f"{k.split('/')[1][:-2]} {v:.3f}" for k, v in
                                                         mean_phase.items() if v), ""]
    lines += memory_lines
    for p in plots:
        lines += [f"## {p.stem}", "", f"![{p.stem}](plots/{p.name})", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
