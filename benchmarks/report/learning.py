"""The sections of docs/benchmarks.md on learning (CPU and GPU, sync against one step off, episodes,
seeds) and healing, and the number formats every section shares; ``benchmarks.report`` writes the page."""

from __future__ import annotations

import re

from benchmarks.common import compile_excess

RENAMED = {
    "async_learning": ("learning_cpu async", "learning_cpu.py async"),
    "episodes_learning": ("learning_cpu episodes", "learning_cpu.py episodes"),
    "distill_learning": ("learning_cpu distill", "learning_cpu.py distill"),
    "learning_seeds": ("learning_cpu seeds", "learning_cpu.py seeds"),
    "vllm_overhead": ("generation overhead", "generation.py overhead"),
    "episodes_gpu": ("async_grpo episodes", "async_grpo.py episodes"),
    "trl_learning": ("trl_grpo learn", "trl_grpo.py learn"),
    "train_efficiency": ("train_step", "train_step/efficiency.py"),
    "memory_sweep": ("train_step sweep", "train_step/sweep.py"),
    "ppo_step_bench": ("train_step ppo", "train_step/ppo.py"),
    "deepspeed_bench": ("train_step deepspeed", "train_step/zero.py"),
    "chaos": ("recovery chaos", "recovery/chaos.py"),
    "healing": ("recovery heal", "recovery/healing.py"),
}
"""The benchmark scripts merged into another's command (issue 52): old name -> (``python -m
benchmarks.`` + this, the file mentioned for a bare path), with the same options and JSON."""


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{digits}f}" if abs(x) < 1000 else f"{x:,.0f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def current_command(text: str) -> str:
    """``text`` with a command recorded before issue 52 in today's form: each script of ``RENAMED``
    is a command of the script it went into, with the same options and JSON."""
    def today(m: re.Match) -> str:
        python, how = m.group(1) or "", m.group(2)
        command, path = RENAMED[m.group(3)]
        if python or how.startswith("-m"):
            return f"{python}-m benchmarks.{command}"
        return f"benchmarks/{path}"

    def module(m: re.Match) -> str:  # a name in it: benchmarks.healing.gpu_config
        return "benchmarks." + RENAMED[m.group(1)][1].removesuffix(".py").replace("/", ".") + "."

    names = "|".join(RENAMED)
    text = re.sub(rf"(python3? )?(-m benchmarks\.|[\w./~-]*benchmarks/)({names})(?:\.py)?(?![\w.])", today, text)
    files = "|".join(k for k, (_, path) in RENAMED.items() if " " not in path)
    return re.sub(rf"(?<![\w/.])benchmarks\.({files})\.(?=[A-Za-z_])", module, text)


def _target(t: dict | None) -> str:
    if not t:
        return "—"
    return f"≤ {t['step_s']} s" + (f", busy ≥ {t['gpu_busy']:.0f}%" if "gpu_busy" in t else "")


def _met(x) -> str:
    return "—" if x is None else "yes" if x else "**no**"


def async_grpo(entries: list | None, link) -> list[str]:
    """``benchmarks/async_grpo.py``: workload W, synchronous against one-step-off, per layout."""
    out = ["## Asynchronous GRPO (workload W)", ""]
    cmd = "python -m benchmarks.async_grpo --out benchmarks/results"
    if not entries:
        return out + [f"Not run yet: `{cmd}` (one GPU: the co-located pair; two GPUs: the split pair too).", ""]
    b = entries[0].get("baseline_h200") or {}
    out += ["`configs/gpu/grpo_w.yaml`: the 0.5b preset, GRPO, 64 prompts × 8 samples, ≤ 256 new tokens at "
            "temperature 1, one AdamW step over the 512 sequences (micro-batch 32), a reference with the k3 KL "
            "(β 0.04) as a loss term, bf16, vLLM. Synchronous (staleness 0) against one-step-off "
            "(`rollout.max_staleness: 1`: batch s+1 generates while step s trains), co-located on one GPU "
            "(vLLM awake beside the trainer) and split (vLLM on a GPU of its own, NCCL). s/step: the median of "
            "the steps after the warm-up steps; GPU busy: nvidia-smi's utilisation every 50 ms over those steps "
            "(the mean of the GPUs used; per GPU below); peak: the device's used memory over all steps. "
            f"Baseline of the issue (one H200, synchronous): {fmt(b.get('step_s'), 2)} s/step (generate "
            f"{fmt(b.get('generate_s'), 2)}, infer {fmt(b.get('infer_s'), 2)}, train {fmt(b.get('train_s'), 2)}, sync "
            f"{fmt(b.get('sync_s'), 2)}; GPU busy {fmt(b.get('gpu_busy'), 0)}%).", "",
            "| GPU | layout | GPUs | staleness | s/step | sync s/step | speed-up | GPU busy (%) | peak (GiB) | target "
            "| met |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        per = e.get("gpu_busy_per_gpu") or []
        busy = fmt(e.get("gpu_busy"), 0) + (f" ({' / '.join(fmt(x, 0) for x in per)})" if len(per) > 1 else "")
        out.append(f"| {e['gpu']} | {e['layout']} | {e['gpus']} | {e['staleness']} | "
                   f"{fmt(e.get('step_s_median'), 2)} | "
                   f"{fmt(e.get('sync_step_s_median'), 2)} | "
                   f"{fmt(e.get('speedup'), 2) + '×' if e.get('speedup') else '—'} | {busy} | "
                   f"{fmt(e.get('peak_gib'), 1)} | {_target(e.get('target'))} | {_met(e.get('met'))} |")
    phases = ["generate", "reward", "infer", "train", "sync", "sleep", "wait_rollout", "wait_generation"]
    out += ["", "Median seconds per phase (with staleness 1, generate and reward overlap the trainer's phases; "
            "`wait_rollout`: the trainer waiting for its batch, `wait_generation`: the sync waiting for a "
            "generation under way):", "",
            "| layout | staleness | " + " | ".join(phases) + " | staleness seen (min / mean / max) |",
            "|---|---|" + "---|" * (len(phases) + 1)]
    for e in entries:
        m, st = e.get("phases_median") or {}, e.get("staleness_observed")
        seen = f"{fmt(st['min'], 0)} / {fmt(st['mean'], 2)} / {fmt(st['max'], 0)}" if st else "—"
        out.append(f"| {e['layout']} | {e['staleness']} | " + " | ".join(fmt(m.get(p), 2) for p in phases)
                   + f" | {seen} |")
    errors = [e for e in entries if e.get("error")]
    out += [""] + [f"* {e['variant']} on {e['gpu']} failed: `{e['error'].rstrip('.')}`." for e in errors]
    out += [f"* {e['variant']} ({e['gpus']} × {e['gpu']}, {e.get('date', '')[:10]}): {e['note']}."
            for e in entries if e.get("note")]
    out += ["", "Commands: " + "; ".join(f"`{c}`" for c in dict.fromkeys(e.get("command", "") for e in entries))
            + f" ({', '.join(sorted({e.get('date', '')[:10] for e in entries}))}).", ""]
    pngs = [(e["layout"], e["staleness"], e["timeline_png"]) for e in entries if e.get("timeline_png")]
    if pngs:
        out += ["What ran when over the last steps of each run (trainer, generator and reward lanes):", ""]
        out += [f"* {layout}, staleness {k}: [{png}]({link(png)})" for layout, k, png in pngs]
        out += [""] + [f"![{layout}, staleness {k}]({link(png)})" for layout, k, png in pngs if k > 0] + [""]
    return out


def async_learning_cpu(r: dict | None) -> list[str]:
    """``benchmarks/learning_cpu.py async``: final eval reward, synchronous against one-step-off, on CPU."""
    out = ["## Asynchronous RL: does it learn as well? (CPU)", ""]
    if r is None:
        return out + ["Not run yet: `python -m benchmarks.learning_cpu async --out benchmarks/results`.", ""]
    out += [f"Each config run synchronously and with `rollout.max_staleness=1` (and `algorithm.tis_cap=2.0` where "
            f"the config sets no off-policy correction), per seed, on {r.get('machine', 'the CPU box')}; the "
            f"greedy eval reward on the held-out prompts after the last step. Verdict: {r['criterion']}. Command: "
            f"`{current_command(r.get('command', ''))}` ({r.get('date', '')[:10]}).", "",
            "| config | steps | seeds | sync: final eval (mean ± std) | async | async ≥ sync − std | "
            "wall s (sync / async, mean) |", "|---|---|---|---|---|---|---|"]
    for c in r["configs"]:
        s, a = c["sync"], c["async"]
        pm = lambda x: ("—" if x["final_mean"] is None  # noqa: E731
                        else f"{fmt(x['final_mean'])} ± {fmt(x['final_std'])}")
        out.append(f"| `{c['config']}` | {c['steps']} | {', '.join(map(str, s['seeds'] or a['seeds']))} | {pm(s)} | "
                   f"{pm(a)} | {_met(c['async_ok'])} | {fmt(s['wall_s_mean'], 0)} / {fmt(a['wall_s_mean'], 0)} |")
    failed = [x for x in r.get("runs", []) if x.get("error")]
    out += [""] + [f"* {x['config']} {x['mode']} seed {x['seed']} failed: `{x['error'].rstrip('.')}`." for x in failed]
    return out + ["", "Each run's eval curve against samples seen (step × prompts per step × samples per prompt) "
                  "and its overrides are in `benchmarks/results/async_learning_cpu.json` (`runs[]`).", ""]


def async_learning_gpu(r: dict | None, link) -> list[str]:
    """``benchmarks/learning_cpu.py async --gpu``: eval reward against the RL clock, sync against async."""
    out = ["### The same on a GPU: reward against wall-clock", ""]
    if r is None:
        return out + ["Not run yet: `python -m benchmarks.learning_cpu async --gpu --out benchmarks/results`.", ""]
    w, runs = r.get("warmup") or {}, r.get("runs") or {}
    out += [f"GPU: **{r.get('gpu')}**. GRPO on the reasoning env (add, compare, sort) with the 0.5b preset, from "
            f"`{r['config']}` with the overrides in the JSON, seed {r.get('seed')}; one supervised warm-up "
            f"({fmt(w.get('seconds'), 0)} s) shared by both runs. Clock: the sum of the RL steps' times (start-up "
            f"excluded, evaluations included in both). Command: `{current_command(r.get('command', ''))}` "
            f"({r.get('date', '')[:10]}).", "",
            "| run | eval before RL | eval after | RL seconds | mean staleness |", "|---|---|---|---|---|"]
    for mode, x in runs.items():
        out.append(f"| {mode} | {fmt(x.get('eval_initial'))} | {fmt(x.get('eval_final'))} | {fmt(x.get('rl_s'), 0)} | "
                   f"{fmt(x.get('staleness_mean'), 2)} |")
    out += ["", f"Async reaches sync's final eval reward ({fmt(r.get('sync_final'))}, reached by sync at "
            f"{fmt(r.get('sync_time_s'), 0)} s) at {fmt(r.get('async_time_to_sync_final_s'), 0)} s: ratio "
            f"**{fmt(r.get('ratio'), 2)}** (target ≤ {r.get('target_ratio')}; met: {_met(r.get('met'))}).", ""]
    if r.get("png"):
        out += [f"![reward against the RL clock]({link(r['png'])})", ""]
    return out


def episodes_cpu(r: dict | None) -> list[str]:
    """``benchmarks/learning_cpu.py episodes``: the episode envs' learning on CPU, tool against no tool."""
    out = ["## Episodes: do the episode envs learn? (CPU)", ""]
    if r is None:
        return out + ["Not run yet: `python -m benchmarks.learning_cpu episodes --out benchmarks/results`.", ""]
    out += [f"On {r.get('machine', 'the CPU box')}, one run at a time, each config as shipped (warm-up and Ray "
            f"start included in wall). Eval: greedy, on the env's held-out problems, after the warm-up (before RL) "
            f"and after the last RL step. Command: `{current_command(r.get('command', ''))}`."
            + (f" Note: {current_command(r['note'])}." if r.get("note") else ""), "",
            "| run | config | seed | RL steps | eval before RL | eval after | tool calls / episode (eval, before → after) "
            "| first-try accuracy (before → after) | wall s | RL s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        ev = x.get("eval") or [{}]

        def span(key: str) -> str:
            a, b = ev[0].get(key), ev[-1].get(key)
            return "—" if a is None else f"{fmt(a, 2)} → {fmt(b, 2)}"
        out.append(f"| {x['run']} | `{x['config']}` | {x.get('seed', 0)} | {x['steps']} | {fmt(x['eval_initial'])} "
                   f"| {fmt(x['eval_final'])} | {span('tool_calls_mean')} | {span('first_turn_correct_mean')} "
                   f"| {fmt(x['wall_s'], 0)} | {fmt(x['rl_s'], 0)} |")
    seeds = [f"* **{name}**, seeds {', '.join(map(str, m['seeds']))}: eval {fmt(m['before_mean'])} → "
             f"**{fmt(m['after_mean'])} ± {fmt(m['after_std'])}** (after: {', '.join(fmt(v) for v in m['after'])}); "
             f"gain {fmt(m['gain_mean'])} on average, {fmt(m['gain_min'])} at the least."
             for name, m in (r.get("summary") or {}).items() if len(m["seeds"]) > 1]
    out += [""] + seeds if seeds else []
    return out + ["", "Per-step rows (train reward, tool calls, turns, truncation) and the eval curves are in "
                  "`benchmarks/results/episodes_cpu.json`; docs/algorithms.md reads them.", ""]


def learning_seeds(r: dict | None) -> list[str]:
    """``benchmarks/learning_cpu.py seeds`` (issue 26): the CPU configs the docs state learning figures for."""
    if not r or not r.get("configs"):
        return []
    out = ["## The CPU configs over seeds (issue 26)", "",
           f"`{current_command(r['command'])}` at {r['commit']} ({r['cpus']} CPUs, from {r['started']}): `xrlhf run "
           "configs/<name>.yaml seed=<s>`, one run at a time; the greedy eval after the warm-up and after the last "
           "step (`rm`: held-out pairwise accuracy; `qa_ppo`: the reward model's score, its reward model trained "
           "once with seed 0). docs/algorithms.md reads these.", "",
           "| config | seeds | initial | final | gain (mean ± std) | gains by seed | wall s by seed |",
           "|---|---|---|---|---|---|---|"]
    for name, c in r["configs"].items():
        runs = c["runs"]
        out.append(f"| `{name}` | {', '.join(str(x['seed']) for x in runs)} | {c['initial_mean']:.3f} "
                   f"| {c['final_mean']:.3f} ± {c['final_std']:.3f} | **{c['gain_mean']:+.3f} ± {c['gain_std']:.3f}** "
                   f"| {' / '.join(format(x['gain'], '+.3f') for x in runs)} "
                   f"| {' / '.join(format(x['wall_s'], '.0f') for x in runs)} |")
    return out + [""]


def learning_retune(r: dict | None) -> list[str]:
    """Issue 26: settings tried over the same seeds for a config whose gain missed its target."""
    if not r or not r.get("tried"):
        return []
    out = ["### Retuned over seeds", "", current_command(r["what"]) + ".", "",
           "| config | overrides | shipped | initial | final | gain (mean ± std) | gains by seed |", "|---|---|---|---|---|---|---|"]
    for t in r["tried"]:
        out.append(f"| `{t['config']}` | {' '.join(t['overrides']) or '(as it was)'} | {'yes' if t['shipped'] else ''} "
                   f"| {t['initial_mean']:.3f} | {t['final_mean']:.3f} ± {t['final_std']:.3f} "
                   f"| **{t['gain_mean']:+.3f} ± {t['gain_std']:.3f}** | {' / '.join(format(x['gain'], '+.3f') for x in t['runs'])} |")
    return out + [""]


def episodes_gpu(entries: list[dict]) -> list[str]:
    """``benchmarks/async_grpo.py episodes``: episodes through vLLM, sync against one-step-off."""
    out = ["## Episodes through vLLM: the calculator env (workload W's engines)", ""]
    if not entries:
        return out + ["Not run yet: `python -m benchmarks.async_grpo episodes --mode sync --out benchmarks/results`.", ""]
    e0 = entries[0]
    out += [f"GPU: **{e0['gpu']}**, co-located (`configs/gpu/grpo_w.yaml`'s engines: vLLM generates, HF trains), "
            f"the {e0['model']}, env `{e0['env']}` (3-digit products, calculator tool, up to 3 turns), GRPO on "
            f"{e0['episodes_per_step']} episodes per step; vLLM serves one request per episode turn, sent the moment "
            f"its episode is ready (continuous batching across turns). The model is warmed up (supervised, 60 "
            f"steps) so that it calls the tool; it is not trained to answer (reward 0), so these are throughput "
            f"figures. Medians over the steps after the first.", "",
            "| mode | s/step | generate s | episodes/s (generation) | episodes/s (step) | sampled tokens/s "
            "| turns / episode | tool calls / episode | tool errors / episode | tokens / episode | truncated |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        mode = "sync" if e["mode"] == "sync" else "one-step-off (`max_staleness: 1`)"
        out.append(f"| {mode} | {fmt(e['step_s_median'], 2)} | {fmt(e['generate_s_median'], 2)} "
                   f"| {fmt(e['episodes_per_s_generation'], 0)} | {fmt(e['episodes_per_s_step'], 0)} "
                   f"| {fmt(e['tokens_per_s'], 0)} | {fmt(e['turns_mean'], 2)} | {fmt(e['tool_calls_mean'], 2)} "
                   f"| {fmt(e['tool_errors_mean'], 2)} | {fmt(e['tokens_mean'], 1)} | {fmt(e['truncated_frac'], 2)} |")
    sync = next((e for e in entries if e["mode"] == "sync"), None)
    asyn = next((e for e in entries if e["mode"] == "async"), None)
    if sync and asyn and sync["step_s_median"] and asyn["step_s_median"]:
        out += ["", f"One-step-off over sync: **{sync['step_s_median'] / asyn['step_s_median']:.2f}×** episodes per "
                f"second of the whole step (back to back on the same machine)."]
    return out + ["", "Commands: " + "; ".join(f"`{e['command']}` ({e['date'][:10]})" for e in entries) + ".", ""]


def learning_gpu(r: dict | None, trl: dict | None, link) -> list[str]:
    """Issue 51: ``configs/gpu/grpo_learn.yaml`` over seeds and variants, and its time to reward beside TRL."""
    out = ["## GRPO that learns on one GPU, and its time to reward beside TRL (issue 51)", ""]
    if r is None:
        out += ["Not run yet: `python -m benchmarks.learning_gpu --out benchmarks/results` (`bash benchmarks/gpu.sh "
                "learn`; the variants: `learn_async`).", ""]
    else:
        w = r.get("warmup") or {}
        out += [f"`{r['config']}` on {r['gpu']}: the policy warmed up once ({w.get('steps')} steps of "
                f"{w.get('batch_size')} demonstrations at lr {w.get('lr')}, {fmt(w.get('seconds'), 0)} s; eval "
                f"before it {fmt(w.get('eval_before_warmup'))}), then GRPO from its weights per variant and seed. "
                f"Greedy eval reward on the held-out problems; RL s: the sum of the steps' times (start-up "
                f"excluded, evaluations included); met: the eval rose by at least {r['margin']}. "
                f"`{r.get('command', '')}`.", "",
                "| variant | seed | eval before RL | last eval | rise | met | RL s | of it the first steps' compile "
                "| s/step |", "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {x['variant']} | {x['seed']} | {fmt(x.get('eval_before_rl'))} | {fmt(x.get('eval_last'))} "
                f"| {fmt(x.get('rise'))} | {_met(x.get('met'))} | {fmt(x.get('rl_s'), 1)} "
                f"| {fmt(compile_excess(x['curve']) if x.get('curve') else None, 1)} "
                f"| {fmt(x['rl_s'] / x['steps'] if x.get('rl_s') else None, 2)} |" for x in r["runs"]]
        out += ["", "The first steps' compile: how much longer the first 5 steps took than the next 5 (the first RL "
                "run on a machine compiles the trainer's graphs, later runs read inductor's cache); the curves "
                "and the comparisons with sync leave it out (the steady clock)."]
        out += [f"* **{v}** against sync of the same seed, on the steady clock: its evals at or above sync's curve "
                f"{', '.join(fmt(a) for a in e.get('at_or_above_sync') or []) or '—'} of the time; sync's last "
                f"eval reached in {', '.join(fmt(t) for t in e.get('time_to_sync_last_ratio') or []) or '—'} x "
                "sync's time (— : not reached)." for v, e in (r.get("variants") or {}).items() if v != "sync"]
        out += [f"* `{r['command_async']}` ({r.get('gpu_async')}, {r.get('date_async')})."] \
            if r.get("command_async") else []
        notes = [f"* {x['variant']} seed {x['seed']} failed: `{x['error']}`." for x in r["runs"] if x.get("error")]
        notes += [f"* not run (time): {', '.join(r['not_run'])}."] if r.get("not_run") else []
        notes += [f"* {r['note']}"] if r.get("note") else []
        out += [""] + (notes + [""] if notes else [])
        out += [f"![eval reward against the RL clock]({link(r['png'])})", ""] if r.get("png") else []
        out += _sweep(r.get("sweep") or [])
    if trl is None:
        return out + ["Beside TRL: not run yet: `python -m benchmarks.learning_gpu --trl --out benchmarks/results` "
                      "(`bash benchmarks/gpu.sh trl_learn`).", ""]
    t = trl["trl"]
    out += [f"Beside TRL ({trl['gpu']}, seed {trl['seed']}, the same warmed model, data and verifier; TRL "
            f"{(t.get('summary') or {}).get('trl', '?')}, exit {t['rc']}; xrlhf's run "
            f"{'in the same call' if trl.get('xrlhf_same_call') else 'from another call of the same lease'}): TRL's "
            f"last eval reward {fmt(trl.get('target'))} (from {fmt(trl.get('trl_first'))}), first reached at "
            f"{fmt(trl.get('trl_s'), 1)} s of its training (evaluations left out); xrlhf reaches it at "
            f"{fmt(trl.get('xrlhf_s'), 1)} s: ratio **{fmt(trl.get('ratio'))}** (target ≤ {trl['target_ratio']}: "
            f"{_met(trl.get('met'))}{'; ' + trl['note'] if trl.get('note') else ''}). `{trl.get('command', '')}`.", "",
            f"![xrlhf beside TRL]({link(trl['png'])})", ""]
    return out


def _sweep(rows: list[dict]) -> list[str]:
    """``learn_sweep``'s candidates (seed 0, one warm-up): what each changed and how far the eval rose."""
    if not rows:
        return []
    out = ["The candidates of `bash benchmarks/gpu.sh learn_sweep` (seed 0, the same warm-up; the winner is "
           "what `--rl-set best` takes):", "", "| candidate | RL overrides | eval before RL | last eval | rise | RL s |",
           "|---|---|---|---|---|---|"]
    out += [f"| {x['name']} | `{' '.join(x.get('rl_set') or [])}` | {fmt(x.get('eval_before_rl'))} "
            f"| {fmt(x.get('eval_last'))} | {fmt(x.get('rise'))} | {fmt(x.get('rl_s'), 1)} |" for x in rows]
    return out + [""]


def healing(r: dict | None) -> list[str]:
    out = ["## Healing: time to recover per role", ""]
    if r is None:
        return out + ["Not run yet: `python -m benchmarks.recovery heal --out benchmarks/results`.", ""]
    out += [f"{r['hardware']}; `{r['command']}`. One PPO run of {r['steps']} steps (tiny model, split layout, "
            f"2 policy ranks, a reward model, checkpoints every step) with a fault every 3 steps at a random point of "
            f"the step; heartbeat timeout {r['heartbeat_timeout_s']:g} s. Final weights bit-identical to the "
            f"uninterrupted run: **{'yes' if r['final_weights_identical'] else 'NO'}**. Wall time "
            f"{r['wall_s_uninterrupted']:.0f} s uninterrupted, {r['wall_s_with_faults']:.0f} s with the faults.", "",
            "`recover_s`: from the failure's detection to the run going on (a restart in place: new workers, "
            "models loaded, weights re-synced; from a checkpoint: every worker and model again, Ray kept). "
            "A frozen worker is detected `heartbeat_timeout_s` after its last answer.", "",
            "| handle | rank | fault | healed | recover (s) | redone |", "|---|---|---|---|---|---|"]
    for f in r["faults"]:
        out.append(f"| {f['handle']} | {f['rank']} | {f['signal']} | {f['healed']} | {fmt(f['recover_s'], 1)} | "
                   f"{f['redone']} |")
    if r.get("gpu") is None:
        return out + ["", "A vLLM generator's restart on a GPU has not been measured yet.", ""]
    for key, where in (("gpu", "on a GPU"), ("gpu2", "on two GPUs")):
        if (g := r.get(key)) is not None:
            out += healing_gpu(g, where)
    return out + [""]


def healing_gpu(g: dict, where: str) -> list[str]:
    """One GPU scenario of ``benchmarks.recovery heal --gpu``: its sentence and its faults' table."""
    date = f", {g['date']}" if g.get("date") else ""
    out = ["", f"With vLLM {where} ({g['hardware']}{date}; `{g['command']}`): {g['scenario']}; heartbeat timeout "
           f"{g['heartbeat_timeout_s']:g} s; run finished (exit {g['exit']}) in {g['wall_s_with_faults']:.0f} s with "
           f"the faults. {g['note']}.", "",
           "| handle | rank | fault | step | healed | recover (s) | redone |", "|---|---|---|---|---|---|---|"]
    for f in g["faults"]:
        out.append(f"| {f['handle']} | {f['rank']} | {f['signal']} | {f['step']} | {f['healed']} | "
                   f"{fmt(f['recover_s'], 1)} | {f['redone']} |")
    return out

