"""Write docs/benchmarks.md from the JSON in benchmarks/results/ (and the hang probe's summary).

    python -m benchmarks.report [--results benchmarks/results] [--hang OUT/hang/summary.json]

Run it after copying a GPU session's ``OUT/benchmarks/results/*.json`` into benchmarks/results/
(and, for the start-up hang section, its ``OUT/hang/summary.json`` to
benchmarks/results/hang_probe.json). Sections whose JSON is missing say so.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.generation import VARIANT_NOTES
from benchmarks.report.learning import (
    _met,
    current_command,
    async_grpo,
    async_learning_cpu,
    async_learning_gpu,
    episodes_cpu,
    episodes_gpu,
    fmt,
    healing,
    learning_gpu,
    learning_retune,
    learning_seeds,
)


def load(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def generation(r: dict | None) -> list[str]:
    out = ["## Generation throughput", ""]
    if r is None:
        return out + ["Not run yet: `python -m benchmarks.generation --out benchmarks/results`.", ""]
    shape = r.get("model_shape") or {}
    hf_by = r.get("hf_tokens_per_s_by_micro_batch") or {}
    out += [f"GPU: **{r['gpu']}**. Model: {r['model_params']:,} parameters (locally built Llama, bf16"
            + (f"; {shape['num_hidden_layers']} layers, width {shape['hidden_size']}, {shape['num_attention_heads']} "
               f"heads, {shape['num_key_value_heads']} key/value heads, vocabulary {shape['vocab_size']:,}" if shape else "")
            + f"), {r['prompts']} prompts × {r['new_tokens']} new tokens (ignore EOS), temperature 1, both engines "
            f"returning per-token logprobs. Command: `{r.get('command', '')}`. GPU busy: the mean of nvidia-smi's "
            "utilisation sampled every 50 ms during the run.", "",
            "| engine | seconds | tokens/s | GPU busy (%) |", "|---|---|---|---|",
            f"| vLLM (`VLLMGenerateEngine`) | {fmt(r.get('vllm_seconds'))} | {fmt(r.get('vllm_tokens_per_s'))} | "
            f"{fmt(r.get('vllm_gpu_utilization'), 0)} |",
            f"| Transformers (`HFGenerateEngine`, micro-batch {r.get('hf_micro_batch_size')}) | "
            f"{fmt(r.get('hf_seconds'))} | {fmt(r.get('hf_tokens_per_s'))} | {fmt(r.get('hf_gpu_utilization'), 0)} |"]
    if "vllm_raw_logprobs_tokens_per_s" in r:
        out += [f"| `vllm.LLM.generate` directly, `logprobs=0` | — | {fmt(r['vllm_raw_logprobs_tokens_per_s'])} | "
                f"{fmt(r.get('vllm_raw_logprobs_gpu_utilization'), 0)} |",
                f"| `vllm.LLM.generate` directly, no logprobs | — | {fmt(r['vllm_raw_no_logprobs_tokens_per_s'])} | "
                f"{fmt(r.get('vllm_raw_no_logprobs_gpu_utilization'), 0)} |"]
    out += ["", f"Speed-up: **{fmt(r.get('speedup'), 1)}×** (target ≥ 10×). "
            + (f"Transformers engine by micro-batch: {', '.join(f'{k}: {fmt(v)} tokens/s' for k, v in hf_by.items())} "
               "(the fastest is compared). " if hf_by else "")
            + f"vLLM start-up: {fmt(r.get('vllm_startup_s'), 1)} s; settings: `{json.dumps(r.get('vllm_options'))}`.", ""]
    return out


def generation_gqa(r: dict | None) -> list[str]:
    """The same benchmark on Qwen2.5-0.5B's attention shape (``--preset 0.5b-gqa``)."""
    if r is None:
        return []
    return ["### The same with grouped-query attention", "",
            "`--preset 0.5b-gqa`: 2 key/value heads instead of 16 (Qwen2.5-0.5B's attention; the KV cache and "
            "its reads 8× smaller), same size. If vLLM were bound by the GPU's memory traffic this would speed it "
            "up; it does not, and the GPU idles most of the time: vLLM is bound by its host work per step.", "",
            "| engine | tokens/s | GPU busy (%) |", "|---|---|---|",
            f"| vLLM (`VLLMGenerateEngine`) | {fmt(r.get('vllm_tokens_per_s'))} | {fmt(r.get('vllm_gpu_utilization'), 0)} |",
            f"| `vllm.LLM.generate`, `logprobs=0` | {fmt(r.get('vllm_raw_logprobs_tokens_per_s'))} | "
            f"{fmt(r.get('vllm_raw_logprobs_gpu_utilization'), 0)} |",
            f"| `vllm.LLM.generate`, no logprobs | {fmt(r.get('vllm_raw_no_logprobs_tokens_per_s'))} | "
            f"{fmt(r.get('vllm_raw_no_logprobs_gpu_utilization'), 0)} |",
            f"| Transformers (micro-batch {r.get('hf_micro_batch_size')}) | {fmt(r.get('hf_tokens_per_s'))} | "
            f"{fmt(r.get('hf_gpu_utilization'), 0)} |", "",
            f"Speed-up {fmt(r.get('speedup'), 1)}×. Command: `{r.get('command', '')}`.", ""]


def vllm_overhead(r: dict | None) -> list[str]:
    """``benchmarks/generation.py overhead``: logprob formats, the garbage collector, batch size, engines per GPU."""
    if r is None or "one_engine" not in r:
        return []
    one = r["one_engine"]
    names = {"xrlhf_engine": "`VLLMGenerateEngine.generate` (flat logprobs)",
             "logprobs_dict": "`logprobs=0`, vLLM's default `list[dict[int, Logprob]]`",
             "logprobs_flat": "`logprobs=0, flat_logprobs=True`", "no_logprobs": "no logprobs"}
    out = ["### Where vLLM's generation time goes", "",
           f"GPU: **{r['gpu']}**, the 0.5B model, one engine, the runs one after another "
           f"(`python -m benchmarks.generation overhead`). Separate start-ups of the same engine differ by "
           "up to ~15%.", "",
           "| run | tokens/s | ms per step | with the caller's GC frozen (tokens/s) |", "|---|---|---|---|"]
    runs = one["runs"]
    for k, label in names.items():
        if k in runs:
            frozen = runs.get(f"{k}_gc_frozen", {})
            out.append(f"| {label} | {fmt(runs[k]['tokens_per_s'])} | {fmt(runs[k].get('ms_per_step'), 2)} | "
                       f"{fmt(frozen.get('tokens_per_s'))} |")
    out += ["", "Milliseconds per decoding step by the number of sequences decoded together "
            "(512 steps each):", "", "| sequences | with logprobs | no logprobs |", "|---|---|---|"]
    out += [f"| {n} | {fmt(v['logprobs'], 2)} | {fmt(v['no_logprobs'], 2)} |" for n, v in one["ms_per_step_by_batch"].items()]
    shared = [r[k] for k in sorted(r) if k.startswith("engines_per_gpu_")]
    if shared:
        out += ["", "Several engines on the one GPU, each in its own process with its share of the 256 prompts, "
                "generating at the same time:", "", "| engines | xrlhf engine (tokens/s) | no logprobs (tokens/s) |",
                "|---|---|---|", f"| 1 | {fmt(runs['xrlhf_engine']['tokens_per_s'])} | "
                f"{fmt(runs['no_logprobs']['tokens_per_s'])} |"]
        out += [f"| {e['engines']} | {fmt(e['xrlhf_engine']['tokens_per_s'])} | {fmt(e['no_logprobs']['tokens_per_s'])} |"
                for e in shared]
    return out + [""]


def vllm_engines_w(r: dict | None) -> list[str]:
    """``generation overhead --engines-per-gpu 1 2 --rounds K`` on W's shape: one engine against two."""
    if r is None:
        return []
    out = ["### One vLLM engine or two on W's shape", "",
           f"GPU: **{r['gpu']}**, the 0.5B model, {r['prompts']} prompts x {r['new_tokens']} new tokens in all, W's "
           "vLLM options; two engines each in its own process with half the prompts, generating at the same time; "
           "the median of the rounds (`python -m benchmarks.generation overhead --engines-per-gpu 1 2 --rounds K`, " + r.get("date", "") + ").", "",
           "| engines | xrlhf engine (s) | its rounds (s) | no logprobs (s) | its rounds (s) |", "|---|---|---|---|---|"]
    for k in sorted(k for k in r if k.startswith("engines_per_gpu_")):
        e = r[k]
        x, n = e["xrlhf_engine"], e["no_logprobs"]
        out.append(f"| {e['engines']} | {fmt(x['seconds'])} | {', '.join(fmt(v) for v in x['rounds_s'])} | "
                   f"{fmt(n['seconds'])} | {', '.join(fmt(v) for v in n['rounds_s'])} |")
    return out + [""]


def vllm_runner(r: dict | None) -> list[str]:
    """vLLM's V2 model runner (0.25.1's default) against V1, one start-up each, one after the other."""
    if r is None:
        return []
    out = ["### vLLM's model runners", "", f"GPU: **{r['gpu']}**, the 0.5B model, 256 × 512. "
           f"Command: `{r['command']}`.", "",
           "| runner | engine (tokens/s) | `logprobs=0` | no logprobs | GPU busy (%): engine / no logprobs |",
           "|---|---|---|---|---|"]
    for name, v in r["runs"].items():
        out.append(f"| {name.split('_')[0].upper()} | {fmt(v['vllm_tokens_per_s'])} | {fmt(v['vllm_raw_logprobs_tokens_per_s'])} "
                   f"| {fmt(v['vllm_raw_no_logprobs_tokens_per_s'])} | {fmt(v['vllm_gpu_utilization'], 0)} / "
                   f"{fmt(v['vllm_raw_no_logprobs_gpu_utilization'], 0)} |")
    return out + ["", "The default (V2) stays. Its engine figure here, 39.8k, against 33.7k in the run above: "
                  "separate start-ups of the same engine differ by up to ~15%.", ""]


def generation_configs(name: str, r: dict | None) -> list[str]:
    """``benchmarks/generation.py --configs``: per engine configuration, each variant's median round
    against the same configuration's floor (``raw_no_logprobs``, vLLM alone without logprobs)."""
    if not r or not r.get("configs"):
        return []
    shape = r.get("model_shape") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items()) or "versions not recorded"
    out = [f"### vLLM configurations, variants on one engine: `{name}`", "",
           f"GPU: **{r['gpu']}**. Model: {r['model_params']:,} parameters ({r.get('model_preset', '?')} preset"
           + (f", {shape.get('num_hidden_layers')} layers, width {shape.get('hidden_size')}, "
              f"{shape.get('num_key_value_heads')} key/value heads" if shape else "")
           + f"), {r['prompts']} prompts ({r.get('samples_per_prompt', 1)} per distinct prompt) × {r['new_tokens']} "
           f"new tokens (ignore EOS), temperature 1; {versions}, {r.get('date', '')}. Seconds: each "
           "variant's median round (rounds interleaved on one engine, pooled over `--passes`; min-max over the rounds). "
           f"Command: `{r.get('command', '')}`.", "",
           "| configuration | start-up (s) | variant | seconds | min-max | tokens/s | ms/step | GPU busy (%) | vs floor |",
           "|---|---|---|---|---|---|---|---|---|"]
    for config, entry in r["configs"].items():
        floor = (entry["variants"].get("raw_no_logprobs") or {}).get("seconds")
        for variant, v in entry["variants"].items():
            spread = f"{fmt(v['min_s'])}-{fmt(v['max_s'])}" if "min_s" in v else "—"
            ratio = f"{v['seconds'] / floor:.2f}x" if floor else "—"
            out.append(f"| {config} | {fmt(entry.get('startup_s'), 1)} | {VARIANT_NOTES.get(variant, variant)} | "
                       f"{fmt(v['seconds'])} | {spread} | {fmt(v.get('tokens_per_s'))} | {fmt(v.get('ms_per_step'), 2)} | "
                       f"{fmt(v.get('gpu_utilization'), 0)} | {ratio} |")
    return out + ([""] + [r["note"]] if r.get("note") else []) + [""]


def weight_sync(r: dict | None) -> list[str]:
    out = ["## Weight sync", ""]
    if r is None:
        return out + ["Not run yet: `python -m benchmarks.weight_sync --out benchmarks/results`.", ""]
    s = r["seconds"]
    gib = r["bytes"] / 2**30
    verified = r.get("verified_seconds", {})
    rows = [("cpu (into vLLM's engine process)", s.get("cpu"), verified.get("cpu")),
            ("disk (safetensors files, `directory`: " + str(r.get("disk_dir", "TMPDIR")) + ")", s.get("disk"),
             verified.get("disk")),
            ("cuda_ipc", s.get("cuda_ipc"), verified.get("cuda_ipc")),
            ("cuda_ipc, packed buckets", r.get("cuda_ipc_packed_seconds"), verified.get("cuda_ipc_packed")),
            ("cuda_ipc from sleep level 2 (wake weights, load, wake KV cache)", r.get("cuda_ipc_sleep_cycle_seconds"),
             None),
            ("nccl (trainer on GPU 1)", s.get("nccl"), verified.get("nccl")),
            ("device-to-device copy (the floor)", r.get("d2d_copy_seconds"), None)]
    steady = r.get("verified_is", "one sync")
    out += [f"GPU: **{r['gpu']}**. {gib:.2f} GiB in {r['tensors']} tensors (bf16, the tied `lm_head` sent too), "
            f"buckets of {r['bucket_mb']} MB, into a vLLM engine on GPU 0; every figure is the median of "
            f"{r['repeats']} steady-state syncs on one transport after a warm-up sync. Command: "
            f"`{r.get('command', '')}` ({r.get('date', '')}).", "",
            f"| transport | seconds | GiB/s | with verify on (s; {steady}) |", "|---|---|---|---|"]
    for name, sec, ver in rows:
        if sec is None and ver is None:
            continue
        out.append(f"| {name} | {fmt(sec)} | {fmt(gib / sec, 1) if sec else '—'} | {fmt(ver)} |")
    setup = r.get("nccl_setup_seconds") or {}
    if setup:
        out += ["", "NCCL group set-up, once per run and not part of a sync: "
                + ", ".join(f"{fmt(v)} s ({k.replace('_', ' ')})" for k, v in setup.items()) + "."]
    sums = r.get("checksum_seconds")
    if sums:
        out += ["", f"What verify costs one side of a sync, the checksum of every tensor: {fmt(sums['one_wait'])} s "
                f"waiting for the GPU once, {fmt(sums['one_wait_per_tensor'])} s waiting after each tensor."]
    note = f" NCCL: {r['nccl_note']}." if r.get("nccl_note") else ""
    note += f" cpu: {r['cpu_note']}." if r.get("cpu_note") else ""
    out += ["", "Targets: CUDA IPC < 0.2 s, NCCL < 0.5 s, cpu >= 2 GiB/s." + note, ""]
    return out


def weight_sync_cpu(r: dict | None) -> list[str]:
    out = ["### Weight sync on CPU", ""]
    if r is None:
        return out + ["Not measured (a probe, since removed: docs/design/probes.md).", ""]
    gib = r["bytes"] / 2**30
    out += [f"The `cpu` transport's host-side path, no GPU: {gib:.2f} GiB in {r['tensors']} float32 tensors (the "
            f"shapes of a 0.5B model), buckets of {r['bucket_mb']} MB, median of {r['repeats']}, on "
            f"**{r.get('machine', 'a shared 2-core CPU box')}** ({r['threads']} torch threads; other jobs running, "
            "so figures vary by up to 3x between runs). Command: "
            "`PYTHONPATH=. python benchmarks/weight_sync_cpu_bench.py --gib 1 --repeats 3` (a probe, since removed: "
            "docs/design/probes.md).", "",
            "| path | pack (s) | pickle / hand-off (s) | unpickle (s) | total (s) | GiB/s |", "|---|---|---|---|---|---|"]
    names = {"old_pickle": "old: per-tensor copies, a list of tensors, in-band pickle",
             "new_pickle": "new: one reused buffer per bucket (numpy), in-band pickle",
             "old_pickle5": "old, out-of-band pickle5 (Ray's object store)",
             "new_pickle5": "new, out-of-band pickle5 (Ray's object store)",
             "new_shm": "new, buffers through reused /dev/shm files (into vLLM's engine process)"}
    for key, label in names.items():
        if key in r:
            x = r[key]
            out.append(f"| {label} | {fmt(x['pack'])} | {fmt(x['pickle'])} | {fmt(x['unpickle'])} | "
                       f"{fmt(x['total'])} | {fmt(x['gib_per_s'], 2)} |")
    out += ["", "Why the first version was slow (1 GB in ~12 s per sync on an H100): pickling a torch tensor "
            "serializes its storage through `torch.save` into a `BytesIO`, several copies into fresh memory per "
            "tensor, and each device-to-host copy went into fresh pageable memory. Now a bucket is one reused "
            "pinned buffer; through Ray's object store nothing else is copied, and into vLLM's engine process the "
            "buffers go through shared-memory files reused from sync to sync (`vllm.extension.ShmPool`), the RPC "
            "carrying only metadata. A 1 GiB copy here: ~0.27 s into reused memory, 1.1-1.9 s into fresh "
            "memory, whose pages fault in.", ""]
    return out


def ppo(r: dict | None) -> list[str]:
    out = ["## PPO step (co-located, one GPU)", ""]
    if r is None:
        return out + ["Not run yet: `python -m benchmarks.train_step ppo --out benchmarks/results`.", ""]
    m = r["median_from_step_2"]
    out += [f"GPU: **{r['gpu']}**. `{r['config']}`, {r['steps']} steps, {r['prompts_per_step']} prompts × "
            f"{r['max_new_tokens']} new tokens per step, weight verification {'on' if r['verify'] else 'off'}. "
            f"Command: `{r.get('command', '')}`.", "",
            "Median over steps 2.. (seconds):", "",
            "| generate | infer | train | sync | sleep | whole step |", "|---|---|---|---|---|---|",
            "| " + " | ".join(fmt(m.get(k)) for k in ("generate_s", "infer_s", "train_s", "sync_s", "sleep_s",
                                                      "step_s")) + " |", "",
            "Peak GPU memory per step (GiB): the device's use sampled by nvidia-smi every 50 ms (vLLM included), and "
            "the sum over the Ray workers of `torch.cuda.max_memory_allocated` (reset every step):", "",
            "| step | device peak | torch peak (workers) |", "|---|---|---|"]
    out += [f"| {s['step']} | {fmt(s['device_peak_gb'], 2)} | {fmt(s['torch_peak_gb'], 2)} |" for s in r["per_step"]]
    ratio = r.get("memory_ratio", {})
    ratios = ", ".join(f"{k.replace('_last_over_step2', '')} {v:.3f}" for k, v in ratio.items())
    out += ["", f"Last step over step 2: {ratios} (target: within 5%).", ""]
    return out


def deepspeed(r: dict | None) -> list[str]:
    out = ["## DeepSpeed train step: ZeRO-2, ZeRO-3, ZeRO-3 + offload", ""]
    cmd = "python -m benchmarks.train_step deepspeed --out benchmarks/results/deepspeed.json"
    if r is None:
        return out + [f"Not run yet (two GPUs): `{cmd}` (or `bash benchmarks/gpu.sh deepspeed`); "
                      "checked on CPU only with `--device cpu --preset tiny`.", ""]
    b = r["global_batch"]
    out += [f"GPU: **{r['device']}** × {r['gpus']}. Model: the `{r['preset']}` preset, {r['params']:,} parameters "
            f"(locally built Llama, {r['dtype']}); `DeepSpeedTrainEngine.train_step` with the SFT loss on a fixed "
            f"batch of {b['rows']} rows × ({b['prompt_len']} + {b['response_len']}) tokens, micro-batches of "
            f"{b['micro_batch_size']} per GPU, gradient checkpointing "
            f"{'on' if r['gradient_checkpointing'] else 'off'}; "
            f"DeepSpeed {r['versions']['deepspeed']}, torch {r['versions']['torch']}. Command: `{cmd}`.", "",
            "| setting | step time (s, mean) | tokens/s | peak GPU memory, rank 0 (GiB) | after set-up (GiB) |",
            "|---|---|---|---|---|"]
    names = {"zero2": "ZeRO-2", "zero3": "ZeRO-3", "zero3_offload": "ZeRO-3 + offload (optimizer and parameters)"}
    out += [f"| {names.get(x['setting'], x['setting'])} | {fmt(x['step_time_s_mean'])} | {fmt(x['tokens_per_s'])} | "
            f"{fmt(x['peak_gpu_mem_gib'], 2)} | {fmt(x['gpu_mem_after_setup_gib'], 2)} |" for x in r["results"]]
    return out + [""]


def hang(r: dict | None) -> list[str]:
    out = ["## vLLM start-up with multiprocessing and CUDA graphs on", ""]
    if r is None:
        return out + ["Not measured (the probe's answer: docs/design/probes.md).", ""]
    out += [f"GPU: **{r['gpu']}**. Command: `{r.get('command', '')}`. Each probe: a fresh process group, "
            "time-limited, stacks of every process dumped at the limit (SIGUSR2; the probe has left the tree: docs/design/probes.md).", "",
            "| probe | result | seconds | start-up s | what changed |", "|---|---|---|---|---|"]
    for name, p in r["results"].items():
        out.append(f"| {name} | {p['status']} | {fmt(p['seconds'], 0)} | {fmt(p.get('startup_s'), 0)} | {p['about']} |")
    out += ["", f"Conclusion: {r['conclusion']}", ""]
    if r.get("XRLHF_VLLM"):
        out += [f"Setting used for the runs above: `XRLHF_VLLM='{json.dumps(r['XRLHF_VLLM'])}'`.", ""]
    return out


def train_efficiency(r: dict | None, lora: dict | None) -> list[str]:
    """``benchmarks/train_step`` (issue 16): packed + chunked against the path before."""
    out = ["## Train efficiency: packed micro-batches, chunked logprobs, LoRA (issue 16)", ""]
    if r is None:
        return out + ["Not run yet: `python -m benchmarks.train_step --out benchmarks/results`.", ""]
    t = r.get("targets") or {}
    out += [f"GPU: **{r['gpu']}**, {r['dtype']}, the 0.5b preset; one process, both paths back to back on the same "
            f"engines, {r['steps']} timed steps each (median). *old*: padded micro-batches of 32 rows, the model's fp32 "
            f"logits over the whole vocabulary, entropy computed; *new*: micro-batches filled to a token budget and "
            f"packed ({r['attention_path']} attention), logprobs from the hidden states in chunks of "
            f"{r['logprob_chunk_tokens']} tokens, no entropy. Peak: the device's peak allocated memory in the phase. "
            f"Command: `{r.get('command', '')}` ({str(r.get('date', ''))[:10]}).", "",
            "| workload | tokens (padded) | micro-batches old / new | train s old / new | x | logprob s old / new | x "
            "| train peak GiB old / new | max abs logprob diff |", "|---|---|---|---|---|---|---|---|---|"]
    for name, w in (("W", r["workload"]), ("long (prompts 32-512, responses 1-1024)", r["long"])):
        out.append(f"| {name} | {w['tokens']:,} ({w['padded_tokens']:,}) | {fmt(w['baseline_micro_batches'], 0)} / "
                   f"{fmt(w['micro_batches'], 0)} | {fmt(w['baseline_train_s'], 2)} / {fmt(w['train_s'], 2)} "
                   f"| {fmt(w['train_speedup'], 2)} | {fmt(w['baseline_logprob_s'], 2)} / {fmt(w['logprob_s'], 2)} "
                   f"| {fmt(w['logprob_speedup'], 2)} | {fmt(w['baseline_train_peak_gib'], 1)} / "
                   f"{fmt(w['train_peak_gib'], 1)} | {fmt(w['max_abs_logprob_diff'], 3)} |")
    out += ["", f"Targets on W: train ≤ {t.get('train_s')} s ({_met(r['train_s'] <= t.get('train_s', 0))}: "
            f"{fmt(r['train_s'], 2)}), logprob phase ≤ {t.get('logprob_s')} s ({_met(r['logprob_s'] <= t.get('logprob_s', 0))}: "
            f"{fmt(r['logprob_s'], 2)}), memory while training ≤ {t.get('train_peak_gib')} GiB "
            f"({_met(r['train_peak_gib'] <= t.get('train_peak_gib', 0))}: {fmt(r['train_peak_gib'], 1)})."]
    c = r["workload"].get("compiled")
    if c:
        out += ["", f"Compiled decoder layers (`compile: true`), W, new path: the first train + logprob calls "
                f"(compiling) {c['first_call_s']:.1f} s; then " + "; ".join(
                    f"{name}: train {fmt(x['train_s'], 2)} s, logprob {fmt(x['logprob_s'], 2)} s, train peak "
                    f"{fmt(x['train_peak_gib'], 1)} GiB" for name, x in c.items() if isinstance(x, dict)) + "."]
    else:
        out += ["", "Compiled decoder layers (`compile: true`; `--compile`): not measured on a GPU yet."]
    if lora:
        for name, x in lora.items():
            out += ["", f"LoRA on W (`configs/gpu/grpo_w_lora.yaml`: r 16 on every linear layer, micro-batch 16, "
                    f"gradient checkpointing, reference = the base with adapters off; `{name}`): the policy workers' "
                    f"peak allocated memory during the update (vLLM asleep) **{x['train_peak_gib_lora']} GiB** "
                    f"(target ≤ 10), sync {', '.join(f'{v:.2f}' for v in x['sync_s'])} s, step "
                    f"{', '.join(f'{v:.1f}' for v in x['step_s'])} s, vLLM-trainer logprob mismatch "
                    f"{x['mismatch_mean'][0]:.4f} nats/token (3 steps; `pytest -m gpu tests/gpu/test_lora_gpu.py`)."]
    return out + [""]


def w_vs_trl(entries: list | None, link) -> list[str]:
    """Issue 25: workload W against TRL's GRPOTrainer, each ratio within one call on one card."""
    if not entries:
        return []
    out = ["## Workload W against TRL's GRPOTrainer (issue 25)", "",
           "`python -m benchmarks.w_vs_trl --trl-dtype <float32|bfloat16|none> --variants <...>` "
           "(`bash benchmarks/gpu.sh w`): TRL 1.16's GRPOTrainer on W (../shared/bench) and "
           "xrlhf's `configs/gpu/grpo_w.yaml` in the same call, steps 3.. medians, 0.5b model, 512 x <= 256 "
           "tokens per step; W2: `configs/gpu/grpo_w2.yaml` (`--config`, `--trl-args`: the 1.5b preset, 256 x <= 480 "
           "tokens, TRL's micro-batch 16). TRL: its dtype and, where recorded, the vLLM it ran on (1.16 declares "
           "0.22-0.31; `--trl-site`). `ratio` = xrlhf / TRL of that call. Phases are xrlhf's step medians (s); busy: "
           "nvidia-smi's utilisation over the timed steps; the card's host CPU where recorded; peak: the device's; "
           "tok/s/GPU: the step's prompt and generated tokens over its time and the GPUs; MFU: the train phase's "
           "model FLOPs over its time and "
           "the GPUs' peak bf16 FLOP/s (both step medians, printed by every run on a GPU).", "",
           "| card | call | workload | xrlhf variant | TRL | TRL s/step | xrlhf s/step | ratio | generate | infer | train "
           "| sync | busy % | peak GiB | tok/s/GPU | train MFU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        ph = e.get("phases") or {}
        workload = "W2" if "grpo_w2" in e.get("config", "") else "W"
        trl_vllm = (e.get("trl_versions") or {}).get("vllm")
        host = f" ({e['host']})" if e.get("host") else ""
        out.append(f"| {e.get('gpu', '')}{host} | {e.get('call', '')} | {workload} | {e['xrlhf_variant']} "
                   f"{' '.join(e.get('overrides') or [])} "
                   f"| {e.get('trl_dtype') or '-'}{f' (vLLM {trl_vllm})' if trl_vllm else ''} | {fmt(e.get('trl_step_s'))} | {fmt(e.get('xrlhf_step_s'))} "
                   f"| {fmt(e.get('ratio'))} | {fmt(ph.get('generate'))} | {fmt(ph.get('infer'))} | {fmt(ph.get('train'))} "
                   f"| {fmt(ph.get('sync'))} | {fmt(e.get('gpu_busy'))} | {fmt(e.get('peak_gib'))} "
                   f"| {fmt(e.get('tokens_per_s_per_gpu'), 0)} | {fmt(e.get('train_mfu'), 2)} |")
    return out + [""]


def startup(r: dict | None) -> list[str]:
    """Issue 25: W's handles ready, cold and warm, with the coordinator's timeline; vLLM alone."""
    if not r or "calls" not in r:
        return []
    t = r["targets"]
    out = ["## Start-up of W's handles (issue 25)", "",
           f"`{r['command']}`: `xrlhf run {r['config']}` for 2 steps per variant, each in a process of its own; "
           f"'cold' empties vLLM's, Inductor's and Triton's caches first. ready: \"Ray handles ready\" (targets: "
           f"{t['cold_ready_s']} s cold, {t['warm_ready_s']} s warm); the coordinator's timeline (s from Ray's "
           "start; summary.json's `startup`): workers up, the generator's vLLM import, vLLM's engine built (after its "
           "import), vLLM's own \"init engine\" line; with the fork server (`ray.fork_server`, 2026-11-28 on): when "
           "it started, its plain copy was made (the trainers' imports done: 2026-11-28, tenth session, on) and it had "
           "imported vLLM (s from Ray's start; negative: before it), the workers forked from them then; trainers "
           "built: the last of the other handles' engines; first step: from the command's start.", "",
           "| call | variant | ready s | first step s | Ray | workers up | vLLM import | fork server started / copy / "
           "imported | vLLM build | generator built | trainers built | vLLM init | compile |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["calls"]:
        for v in c["variants"]:
            tl, vl = v.get("timeline") or {}, v.get("vllm") or {}
            fork = "—"
            if any(k.startswith("fork_server/") for k in tl):
                fork = " / ".join(fmt(tl.get(f"fork_server/{k}_s")) for k in ("started", "plain", "imported"))
            trainers = [v for k, v in tl.items() if k.endswith("/built_s") and not k.startswith("rollout/")]
            out.append(f"| {c.get('label', c['call'])} | {v['variant']} | {fmt(v.get('ready_s'))} | {fmt(v.get('first_step_s'))} "
                       f"| {fmt(tl.get('ray_s'))} | {fmt(tl.get('rollout/up_s'))} | {fmt(tl.get('rollout/imports_s'))} "
                       f"| {fork} | {fmt(tl.get('rollout/generate_s'))} | {fmt(tl.get('rollout/built_s'))} "
                       f"| {fmt(max(trainers) if trainers else None)} | {fmt(vl.get('engine_init_s'))} "
                       f"| {fmt(vl.get('compile_s'))} |")
    out += [""] + [f"* {c.get('label', '')}: {c['call']} ({c['gpu']})." for c in r["calls"]]
    e = r.get("engine")
    if e:
        out += ["", f"vLLM's engine alone ({e['call']}; {e['gpu']}):", "",
                "| variant | import s | engine s | vLLM init s | compile s | tokens/s with logprobs | without |",
                "|---|---|---|---|---|---|---|"]
        for v in e["variants"]:
            g1, g2 = v.get("generate_logprobs") or {}, v.get("generate_no_logprobs") or {}
            out.append(f"| {v['variant']} | {fmt(v.get('import_s'))} | {fmt(v.get('engine_s'))} "
                       f"| {fmt(v['vllm'].get('engine_init_s'))} | {fmt(v['vllm'].get('compile_s'))} "
                       f"| {fmt(g1.get('tokens_per_s'))} | {fmt(g2.get('tokens_per_s'))} |")
    return out + [""]


def train_matrix(r: dict | list | None) -> list[str]:
    """Issue 25: W's train step and logprob phase by precision and token budget."""
    rows = r.get("rows", r) if isinstance(r, dict) else r
    if not rows:
        return []
    gpu = r.get("gpu", "") if isinstance(r, dict) else ""
    out = ["## W's train step by precision and token budget (issue 25)", "",
           f"`python -m benchmarks.train_step --matrix --out benchmarks/results` on {gpu or 'the GPU'}: W's "
           "batch (512 sequences, ~145k tokens), one AdamW step; the logprob phase with and without the policy's "
           "old-logprob forward (skipped for a single on-policy step). 'derived': budgets sized from free memory "
           "(engines/budget.py); 'W': the hand-set 32 rows / 6,144 tokens of before. busy: the profiler's.", "",
           "| variant | train s | logprobs s | without old s | peak GiB | tokens/s | busy | micro-batches |",
           "|---|---|---|---|---|---|---|---|"]
    for x in rows:
        out.append(f"| {x.get('variant')} | {fmt(x.get('train_s'))} | {fmt(x.get('infer_s'))} "
                   f"| {fmt(x.get('infer_s_without_old_logprobs'))} | {fmt(x.get('peak_gib'))} "
                   f"| {fmt(x.get('tokens_per_s'), 0)} | {fmt(x.get('gpu_busy'))} | {x.get('micro_batches', '')} |")
    return out + [""]


def logprob_head(r: dict | None) -> list[str]:
    """Issue 25: W's train step and logprob phase with the logprob chunks compiled and eager."""
    if not r:
        return []
    out = ["## The logprob chunks compiled (issue 25)", "",
           f"`{r['command']}` on {r['gpu']}: W's batch, mixed precision, derived budgets, compiled layers; the "
           "chunked logprob head through `torch.compile` (as shipped since 2026-11-26d) or eager. Kernel tables: "
           f"`benchmarks/results/{r['kernels']}`.", "",
           "| call | variant | train s | logprobs s | without old s | peak GiB | busy | micro-batches |",
           "|---|---|---|---|---|---|---|---|"]
    for sample in r["samples"]:
        for x in sample["rows"]:
            out.append(f"| {sample['call']} | {x['variant']} | {fmt(x.get('train_s'))} | {fmt(x.get('infer_s'))} "
                       f"| {fmt(x.get('infer_s_without_old_logprobs'))} | {fmt(x.get('peak_gib'))} "
                       f"| {fmt(x.get('gpu_busy'))} | {x.get('micro_batches', '')} |")
    return out + [""]


INDEX = """\
This page is written by `python -m benchmarks.report` from the tables in benchmarks/results/ (one
JSON per benchmark, the newest figures) and the session notes (benchmarks/results/notes.md). On a
GPU machine every benchmark runs through one entry point, `bash benchmarks/gpu.sh setup STAGE ...`
(the stack shipped first: docs/testing.md); each stage packs its logs and tables into one archive in
`$OUT`, whose JSON is copied into benchmarks/results/ before this page is written again.

| benchmark | what it measures | run it | table |
|---|---|---|---|
| `w_vs_trl.py` (TRL's side: `trl_grpo.py`, its `w`) | workload W's step time, phases, GPU busy and peak, as shipped and by variant, against TRL's `GRPOTrainer` in the same call | `gpu.sh w` (`hooks`, `hooks_async`, `w2`, `w7trl w7`) | `w_vs_trl.json` |
| `generation.py` | tokens/s of vLLM against the Transformers engine; `overhead`: where vLLM's time goes, engines per GPU | `gpu.sh generation` | `generation*.json`, `vllm_*.json` |
| `weight_sync.py` | one weight sync per transport (cpu, cuda_ipc, nccl) against a device copy of the same weights | `gpu.sh weight_sync` | `weight_sync.json` (the cpu transport's host path: `weight_sync_cpu.json`) |
| `startup.py` | W's handles ready, cold and warm, with the coordinator's timeline | `gpu.sh startup` | `startup.json` |
| `learning_gpu.py` (TRL's side: `trl_grpo.py learn`) | the GPU learning recipe over seeds and variants; its time to reward beside TRL | `gpu.sh learn` (`learn_async`, `trl_learn`) | `learning_gpu.json`, `learning_vs_trl.json` |
| `learning_cpu.py` | does it learn on a CPU, over seeds, per algorithm and run shape: `async`, one step off against synchronous (`--gpu`: the same on one GPU); `episodes`, the episode envs and the calculator tool; `distill`, the distillation recipe; `seeds`, every CPU config the docs give a learning figure for (the README's quickstart table too) | CPU: `python -m benchmarks.learning_cpu SUITE` (`async`, `episodes`, `distill`, `seeds`) | `async_learning_cpu.json`, `episodes_cpu.json`, `distill_cpu*.json`, `learning_seeds.json`, `quickstart_seeds.json` |
| `async_grpo.py` | one step off against synchronous on one or two GPUs: step time on W; `episodes`: the calculator env's episodes through vLLM | GPU: `python -m benchmarks.async_grpo`, `python -m benchmarks.async_grpo episodes` | `async_grpo.json`, `episodes_gpu_*.json` |
| `train_step/` | the train step and logprob phase by code path, precision and token budget; `sweep`: the train peak by budget (the plan's activation model); `ppo`: PPO's step co-located on one GPU; `deepspeed`: ZeRO-2/3/offload on two | `gpu.sh train`, `gpu.sh sweep`, `gpu.sh ppo`, `gpu.sh deepspeed` | `train_efficiency*.json`, `logprob_head_h100.json`, `ppo_step.json`, `deepspeed.json`; the sweep: `plan_measured.json` |
| the plan against a run | the plan's memory against measured GPU runs within 10-15% | `pytest tests/plan/test_measured.py` (CPU) | `plan_measured.json` |
| `recovery/` | `heal`: time to recover per role and fault, final weights against an uninterrupted run; `chaos`: runs SIGKILLed at five moments and resumed: the kill landed, no process left, the uninterrupted run's weights, each prompt trained on as often | CPU: `python -m benchmarks.recovery heal`, `gpu.sh heal`; `make chaos` (CPU, ~30 minutes) | `healing.json`; `chaos.json`, `chaos.md` |
| `report/` | writes this page from the tables | `python -m benchmarks.report` | — |

**Raw logs.** The per-call folders of the GPU sessions (`benchmarks/results/gpu_i12` ... `gpu_i29`:
logs, metrics, kernel tables) and the sessions' own scripts (`gpu_session.sh`, `gpu_i16.sh`,
`gpu_i17.sh`, `gpu_i25.sh`, `gpu_i25_gen.sh`, `gpu_i29.sh`) and probes have left the tree (issue 52):
they stay in the history: `git show 77b7b1d:benchmarks/results/gpu_i25/...` or
`git archive 77b7b1d benchmarks/results | tar -x` brings them back.
A folder such as `gpu_i25/2026-11-26c/`, a stage such as `gpu_i25.sh carvesweep` or a probe such as
`hostprobe.py` in the notes and tables below names what that commit holds; the probes' answers are
in docs/design/probes.md, and the figures the plan's tests need are in `plan_measured.json`.
""".splitlines() + [""]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--hang", default=None, help="default: <results>/hang_probe.json")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = p.parse_args()
    res = Path(args.results).resolve()
    lines = ["# Benchmarks", "", *INDEX]
    lines += generation(load(res / "generation.json"))
    lines += generation_gqa(load(res / "generation-0.5b-gqa.json"))
    lines += vllm_overhead(load(res / "vllm_overhead.json"))
    lines += vllm_engines_w(load(res / "vllm_engines_w.json"))
    lines += vllm_runner(load(res / "vllm_runner.json"))
    for f in sorted(res.glob("generation[-_]*.json")):  # --configs runs (generation-<name>.json)
        lines += generation_configs(f.name, load(f))
    lines += weight_sync(load(res / "weight_sync.json"))
    lines += weight_sync_cpu(load(res / "weight_sync_cpu.json"))
    lines += ppo(load(res / "ppo_step.json"))
    lines += hang(load(Path(args.hang) if args.hang else res / "hang_probe.json"))
    lines += deepspeed(load(res / "deepspeed.json"))
    link = lambda name: os.path.relpath(res / name, Path(args.out).resolve().parent)  # noqa: E731
    lines += async_grpo(load(res / "async_grpo.json"), link)
    lines += async_learning_cpu(load(res / "async_learning_cpu.json"))
    lines += async_learning_gpu(load(res / "async_learning_gpu.json"), link)
    lines += train_efficiency(load(res / "train_efficiency.json"), load(res / "lora_gpu.json"))
    lines += episodes_cpu(load(res / "episodes_cpu.json"))
    lines += learning_seeds(load(res / "learning_seeds.json"))
    lines += learning_retune(load(res / "learning_retune.json"))
    lines += episodes_gpu([e for m in ("sync", "async") if (e := load(res / f"episodes_gpu_{m}.json"))])
    lines += w_vs_trl(load(res / "w_vs_trl.json"), link)
    lines += learning_gpu(load(res / "learning_gpu.json"), load(res / "learning_vs_trl.json"), link)
    lines += startup(load(res / "startup.json"))
    lines += train_matrix(load(res / "train_efficiency_matrix.json"))
    lines += logprob_head(load(res / "logprob_head_h100.json"))
    lines += healing(load(res / "healing.json"))
    notes = res / "notes.md"  # what a person read off the logs: kept beside the JSON, appended as is
    if notes.is_file():
        lines += ["", notes.read_text().rstrip(), ""]
    Path(args.out).write_text(current_command("\n".join(lines)))  # old scripts' commands by today's names
    print(f"wrote {args.out}")

