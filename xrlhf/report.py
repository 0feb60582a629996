"""``report.md`` and PNG plots of a run, from ``metrics.jsonl`` (and ``transcripts.jsonl``) alone.

Works for a finished or an interrupted run: ``xrlhf report RUN_DIR`` regenerates it. An episode
run gets an "Episodes" section (turns, tool calls, errors and timeouts, truncation) and, where
the evaluation wrote them (:func:`write_transcripts`), a few sampled transcripts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from xrlhf.utils.errors import UserError

PHASES = ["time/generate_s", "time/reward_s", "time/infer_s", "time/train_s", "time/sync_s"]
"""Phases of a step (with an asynchronous rollout generate and reward overlap the others:
``plots/timeline.png`` shows how)."""
PLOTS: dict[str, tuple[str, list[str]]] = {
    "reward": ("reward (train samples) and eval reward (held out)",
               ["reward/mean", "eval/reward_mean", "eval/teacher_reward_mean"]),
    "kl": ("KL(policy || reference), nats per sequence", ["kl/mean"]),
    "distill": ("reverse KL(student || teacher), nats per token, on the student's samples",
                ["distill/reverse_kl", "distill/reverse_kl_right", "distill/reverse_kl_wrong"]),
    "losses": ("losses", ["policy/loss", "critic/loss"]),
    "throughput": ("generated tokens per second", ["perf/gen_tokens_per_s"]),
}


TRUNCATION_WARN = 0.2
"""An episode run whose last step truncated more than this fraction gets a note in the report."""
TRANSCRIPTS = "transcripts.jsonl"


def tidy(value: Any) -> str:
    """A number as a report shows it: 4 significant digits (``0.28515625`` -> ``0.2852``,
    ``1234.5`` -> ``1234``), integers as they are; anything else as ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


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
    episodes = make_episodes_plot(rows, out)
    written += [episodes] if episodes is not None else []
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


def make_episodes_plot(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """``episodes.png``: every ``episode/*`` metric per step (turns, tool calls, errors,
    timeouts, truncation, ...); ``None`` for a run without episodes."""
    keys = sorted({k for r in rows for k in r if k.startswith("episode/") and isinstance(r[k], (int, float))})
    keys = [k for k in keys if not k.startswith(("episode/tokens", "episode/sampled_tokens"))]  # another scale
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key in keys:
        ax.plot(*series(rows, key), label=key.split("/", 1)[1])
    ax.set(title="episodes: per-episode means and fractions, per step", xlabel="RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / "episodes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_timeline(rows: list[dict[str, Any]], out: Path, last: int = 4) -> Path | None:
    """``timeline.png``: what ran when on each lane (trainer, generator, reward) over the last
    ``last`` steps (each step's ``timeline`` spans, ``utils.timeline``); None without spans."""
    fig = timeline_figure(rows, last)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path = out / "timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_figure(rows: list[dict[str, Any]], last: int = 4):
    """The timeline's figure (see :func:`make_timeline`), or ``None``. A bar is labelled with
    its name only where the label fits inside it and overlaps no other label (the trainer's
    ``update`` bar, under its parts, only where no part is labelled)."""
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
    labels, colors = [], {}
    for order in (0, 1):  # the trainer's whole 'update' first, its parts on top
        for lane, name, start, end in spans:
            if (name == "update") != (order == 0):
                continue
            y = lanes.index(lane)
            color = LANE_COLORS.get(name, "tab:blue" if lane == "generator" else "tab:green")
            # one key per colour: a lane's batch bars (b4, b4.1, ...) share their lane's
            colors.setdefault(name if name in LANE_COLORS else f"{lane} (bN: batch N)", color)
            ax.barh(y, end - start, left=start - t0, height=0.6, color=color, edgecolor="white", linewidth=0.5)
            text = ax.text((start + end) / 2 - t0, y, name, ha="center", va="center", fontsize=7)
            labels.append((text, start - t0, end - t0, y, name == "update"))
    for r in steps:  # where each step ended
        ends = [s[3] for s in r["timeline"] if s[0] == "trainer"]
        if ends:
            ax.axvline(max(ends) - t0, color="0.5", lw=0.6, ls=":")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set(title=f"timeline of steps {steps[0]['step']}-{steps[-1]['step']} (dotted: a step ends)", xlabel="s")
    from matplotlib.patches import Patch

    # the key of every colour: a bar too narrow for its label is still named
    ax.legend(handles=[Patch(color=c, label=n) for n, c in colors.items()], loc="center left", bbox_to_anchor=(1.0, 0.5),
              fontsize=7, frameon=False)
    fig.tight_layout()
    _keep_fitting_labels(fig, ax, labels)
    return fig


def _keep_fitting_labels(fig, ax, labels: list[tuple[Any, float, float, int, bool]]) -> None:
    """Remove each bar label wider than its bar or overlapping a label kept before it (parts
    before the ``update`` bars under them, wider bars first)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    kept = []
    for text, x0, x1, y, is_update in sorted(labels, key=lambda t: (t[4], -(t[2] - t[1]))):
        box = text.get_window_extent(renderer).expanded(1.1, 1.0)
        (px0, _), (px1, _) = ax.transData.transform([(x0, y), (x1, y)])
        if box.width > abs(px1 - px0) or any(box.overlaps(other) for other in kept):
            text.remove()
        else:
            kept.append(box)


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


def episode_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's "Episodes" section: each ``episode/*`` metric at the first and the last step,
    and ``eval/`` at the first and last evaluation; a note when the last step truncated more
    than :data:`TRUNCATION_WARN` of its episodes. Empty for a run without episodes."""
    steps = [r for r in rows if any(k.startswith("episode/") for k in r)]
    if not steps:
        return []
    evals = [r for r in rows if "eval/reward_mean" in r]
    keys = sorted({k.split("/", 1)[1] for r in steps for k in r if k.startswith("episode/")})
    first, last = steps[0], steps[-1]
    lines = ["## Episodes", "", f"| | step {first.get('step')} | step {last.get('step')} |"
             + ("" if not evals else f" eval, step {evals[0].get('step')} | eval, step {evals[-1].get('step')} |"),
             "|---|---|---|" + ("---|---|" if evals else "")]
    for key in keys:
        cells = [first.get(f"episode/{key}"), last.get(f"episode/{key}")]
        cells += [evals[0].get(f"eval/{key}"), evals[-1].get(f"eval/{key}")] if evals else []
        lines.append(f"| {key} | " + " | ".join("—" if c is None else tidy(c) for c in cells) + " |")
    truncated = last.get("episode/truncated_frac")
    if isinstance(truncated, (int, float)) and truncated > TRUNCATION_WARN:
        lines += ["", f"**{truncated:.0%} of the last step's episodes were truncated** (a turn hit "
                      f"`policy.generate.max_new_tokens` without its stop token, or the episode ran out of `max_turns` "
                      f"or `env.options.max_episode_tokens`): if the transcripts show cut-off turns, the budget is too "
                      f"small for what the policy writes (a warm-up teaches turns as long as its demonstrations)."]
    return lines + [""]


def teacher_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A distillation run's ``## Student and teacher`` section: each evaluation's reward of the two
    side by side (the teacher is evaluated once: its weights never change), the reverse KL to the
    teacher and the teacher's scoring throughput; nothing for other runs."""
    evals = [r for r in rows if "eval/teacher_reward_mean" in r and "eval/reward_mean" in r]
    if not evals:
        return []
    lines = ["## Student and teacher", "", "| step | student eval reward | teacher eval reward | student / teacher |",
             "|---|---|---|---|"]
    for r in evals:
        t = r["eval/teacher_reward_mean"]
        ratio = tidy(r["eval/reward_mean"] / t) if t else "-"
        lines.append(f"| {r['step']} | {tidy(r['eval/reward_mean'])} | {tidy(t)} | {ratio} |")
    steps = [r for r in rows if "distill/reverse_kl" in r]
    if steps:
        first, last = steps[0], steps[-1]
        tps = [r["perf/teacher_tokens_per_s"] for r in steps if "perf/teacher_tokens_per_s" in r]
        kl = "distill/reverse_kl"
        lines += ["", f"Reverse KL to the teacher, nats per token of the student's samples: "
                      f"{tidy(first[kl])} at step {first['step']}, {tidy(last[kl])} at step {last['step']}"
                  + "".join(f"; {w} answers {tidy(last[k])}" for w, k in (("right", "distill/reverse_kl_right"),
                                                                          ("wrong", "distill/reverse_kl_wrong"))
                            if k in last) + "."]
        if tps:
            lines.append(f"Teacher logprobs: {tidy(sum(tps) / len(tps))} response tokens/s (mean over steps).")
    return lines + [""]


def write_transcripts(run_dir: str | Path, step: int, trajectories: Sequence[Any], tokenizer, n: int = 4,
                      what: str = "eval") -> Path:
    """Append ``n`` of ``trajectories`` (evenly spread over them) to ``transcripts.jsonl`` as text,
    replacing what an earlier call wrote for ``step`` or later (a resumed run evaluates again).

    Args:
        run_dir: the run directory.
        step: the RL step of the evaluation (or rollout) the trajectories come from.
        trajectories: finished episodes (``xrlhf.algorithms.rollout.episodes.Trajectory``: ``prompt_ids``,
            ``tokens``, ``reward``, ``correct``, ``truncated``, ``turns``, ``counters``).
        tokenizer: the policy's; the conversation is decoded with its special tokens (the chat
            template's markers show where each turn and observation begins and ends).
        n: how many to keep.
        what: where they come from (``eval``, ``train``).

    Returns:
        the path of ``transcripts.jsonl``; :func:`write_report` shows the last step's.
    """
    path = Path(run_dir) / TRANSCRIPTS
    kept = [r for r in read_jsonl(path) if r.get("step", -1) < step]
    picks = sorted({round(i * len(trajectories) / n) for i in range(n)} & set(range(len(trajectories))))
    for i in picks:
        t = trajectories[i]
        kept.append({"step": step, "what": what, "sample": i, "reward": round(float(t.reward), 4),
                     "correct": t.correct, "truncated": bool(t.truncated), "turns": int(t.turns),
                     "counters": {k: round(float(v), 4) for k, v in (t.counters or {}).items()},
                     "prompt": tokenizer.decode(t.prompt_ids, skip_special_tokens=False),
                     "episode": tokenizer.decode(t.tokens, skip_special_tokens=False)})
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file (none if it does not exist; a torn line is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def transcript_lines(run_dir: Path) -> list[str]:
    """The report's "Sampled transcripts" section: the last step's :func:`write_transcripts`."""
    records = read_jsonl(run_dir / TRANSCRIPTS)
    if not records:
        return []
    step = max(r.get("step", 0) for r in records)
    lines = [f"## Sampled transcripts ({records[-1].get('what', 'eval')}, step {step})", ""]
    for r in [r for r in records if r.get("step", 0) == step]:
        judged = {True: "right", False: "wrong", None: "not judged"}[r.get("correct")]
        counters = ", ".join(f"{k} {tidy(v)}" for k, v in r.get("counters", {}).items())
        lines += [f"Sample {r.get('sample')}: reward {tidy(r.get('reward'))}, {judged}, {r.get('turns')} turn(s)"
                  + (", truncated" if r.get("truncated") else "") + (f"; {counters}" if counters else ""), "",
                  "````text", (r.get("prompt", "") + r.get("episode", "")).rstrip(), "````", ""]
    return lines


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
                lines.append(f"| {key} | {tidy(summary[key])} |")
        lines.append("")
    if steps:
        last = steps[-1]
        mean_phase = {k: sum(r.get(k) or 0.0 for r in steps) / len(steps) for k in PHASES}
        lines += [f"Last logged step: {last['step']}; train reward {last['reward/mean']:.3f}.", "",
                  "Mean seconds per phase: " + ", ".join(f"{k.split('/')[1][:-2]} {v:.3f}" for k, v in
                                                         mean_phase.items() if v), ""]
    lines += memory_lines + episode_lines(rows) + teacher_lines(rows)
    for p in plots:
        lines += [f"## {p.stem}", "", f"![{p.stem}](plots/{p.name})", ""]
    lines += transcript_lines(run_dir)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
