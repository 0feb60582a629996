"""Train step and logprob phase: the path before issue 16 vs packed micro-batches + chunked logprobs.

On workload W's shapes (configs/gpu/grpo_w.yaml: the 0.5b preset, 512 sequences of a prompt of
16-40 tokens and a 256-token response, one optimizer step over all of them, micro-batches of
32 rows, GRPO's loss with the k3 KL term and TIS) it times, back to back in one process and on
the same engines:

* ``baseline``: today's path before issue 16: every micro-batch padded to its width, the
  model's fp32 logits over the whole vocabulary, the entropy computed (PPO's loss always asked);
* ``new``: micro-batches filled to a token budget and packed into one row (varlen attention),
  logprobs from the hidden states chunk by chunk, no entropy (no loss term or metric needs it).

For each: seconds per train step (one optimizer step over the batch), seconds per logprob
phase (the old policy's and the reference's forward, as ``PolicyGradient`` runs them)
and the device's peak memory during each. Then a longer workload (prompts of 32-512 tokens,
responses of 1-1024), where padding costs most, reports the packed path's speed-up as a ratio.
Both paths' logprobs on the same weights are compared (``max_abs_logprob_diff``).

Writes ``train_efficiency.json`` (``gpu``, ``train_s``, ``logprob_s``, ``train_peak_gib``,
``logprob_peak_gib`` and the same with ``baseline_``; ``long``: the same for the long workload
plus the ratios). On the GPU machine::

    python -m benchmarks.train_step --out benchmarks/results

``--smoke`` runs the same on a tiny model on the CPU in seconds (peak memory is ``null`` there).

``--matrix`` (issue 25) measures instead, on W's shape and the same batch, the train step and the
logprob phase for each precision: fp32 weights under bf16 autocast (the path before issue 25,
rebuilt here: ``as_before_issue_25``), mixed precision (bf16 weights, fp32 masters: the GPU
default) and pure bf16; each with the token budgets derived for the GPU (``engines.budget``) and
with W's hand-set ones (32 rows / 6,144 tokens; old logprobs and reference 64 / 16,384); the
logprob phase with the policy's old-logprob forward and without it (the reference alone: GRPO's
on-policy step skips it); with ``--compile`` the fastest variant again with compiled layers.
One row per variant in ``train_efficiency_matrix.json`` (``variant``, ``train_s``, ``infer_s``,
``infer_s_without_old_logprobs``, ``peak_gib``, ``tokens_per_s``, ``gpu_busy`` and
``gpu_busy_infer`` from torch's profiler, the micro-batch count and budgets, the attention kernel
that ran). On one H100, in one call of about 5 minutes::

    python -m benchmarks.train_step --matrix --compile --out $OUT
"""

from __future__ import annotations

import argparse
import random
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ensure_model, gpu_name, table, write_json
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.data.batch import Batch, build_sequences
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFInferEngine, HFTrainEngine


@dataclass
class Workload:
    """Rows of a prompt of ``prompt`` tokens and a response of ``response`` tokens (inclusive
    ranges), trained in one optimizer step; ``rows`` per micro-batch on the padded path,
    ``rows_cap``/``budget`` (tokens) on the packed one."""

    name: str
    sequences: int
    prompt: tuple[int, int]
    response: tuple[int, int]
    rows: int
    rows_cap: int
    budget: int
    infer_rows: int


W = Workload("W", 512, (16, 40), (256, 256), rows=32, rows_cap=32, budget=6144, infer_rows=64)
LONG = Workload("long", 256, (32, 512), (1, 1024), rows=8, rows_cap=64, budget=16384, infer_rows=16)
SMOKE_W = Workload("W", 24, (2, 6), (8, 8), rows=4, rows_cap=8, budget=48, infer_rows=8)
SMOKE_LONG = Workload("long", 16, (2, 12), (1, 24), rows=4, rows_cap=8, budget=64, infer_rows=4)


def make_batch(w: Workload, vocab: int, seed: int = 0) -> Batch:
    """``w.sequences`` random rows with what GRPO's policy loss reads (old, reference and rollout
    logprobs near a random model's, advantages)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*w.prompt))] for _ in range(w.sequences)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(*w.response))] for _ in range(w.sequences)]
    batch = build_sequences(prompts, responses, pad_id=0)
    g = torch.Generator().manual_seed(seed)
    shape = batch["response_mask"].shape
    for key in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        batch[key] = -10.4 + 0.01 * torch.randn(shape, generator=g)
    batch["advantages"] = torch.randn(shape, generator=g)
    return batch


def use_path(engines: list[Any], new: bool, rows: int, budget: int | None, chunked: bool | None = None) -> None:
    """Switch engines built with the defaults between the old and the new path in place
    (``chunked``: the logprob head, default: the new path's with it, the old one's without).
    Without a budget, micro-batches are ``rows`` rows (no budget derived for the GPU)."""
    for e in engines:
        e.hf.attention_path = e.hf_path if new else "padded"
        e.hf.logprob_chunk = e.hf_chunk if (new if chunked is None else chunked) else 0
        e.options.micro_batch_size = rows
        e.options.max_tokens_per_micro_batch = budget if new else None
        e.derived_budget = lambda infer: None  # issue 16's paths: rows or the budget given here


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def _reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def time_train(policy: HFTrainEngine, batch: Batch, loss: PolicyLoss, steps: int, device: str
               ) -> tuple[float, float | None, dict[str, float]]:
    """Seconds per ``train_step`` (after one warm-up step), the peak memory, the last metrics."""
    policy.train_step(batch, loss)
    _sync(device)
    _reset(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        metrics = policy.train_step(batch, loss)
    _sync(device)
    return (time.perf_counter() - t0) / steps, _peak(device), metrics


def time_logprobs(policy: HFTrainEngine, reference: HFInferEngine, batch: Batch, steps: int, device: str
                  ) -> tuple[float, float | None]:
    """Seconds per logprob phase (old policy + reference ``infer``) and the peak memory."""
    inputs = batch.select("input_ids", "attention_mask", "response_mask")
    policy.infer(inputs)
    reference.infer(inputs)
    _sync(device)
    _reset(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        policy.infer(inputs)
        reference.infer(inputs)
    _sync(device)
    return (time.perf_counter() - t0) / steps, _peak(device)


def run_workload(w: Workload, policy: HFTrainEngine, reference: HFInferEngine, steps: int, device: str,
                 vocab: int) -> dict[str, Any]:
    """Both paths on ``w``: times, peaks, and how far their logprobs are apart on the same weights."""
    batch = make_batch(w, vocab)
    attn = batch["attention_mask"]
    out: dict[str, Any] = {"sequences": w.sequences, "prompt_len": list(w.prompt), "response_len": list(w.response),
                           "tokens": int(attn.sum()), "padded_tokens": attn.numel()}
    inputs = batch.select("input_ids", "attention_mask", "response_mask")
    logprobs = {}
    for new in (False, True):  # the same weights first: training moves them
        use_path([policy], new, w.rows_cap if new else w.rows, w.budget)
        logprobs[new] = policy.infer(inputs)["logprobs"]
    for new in (False, True):
        prefix = "" if new else "baseline_"
        use_path([policy], new, w.rows_cap if new else w.rows, w.budget)
        use_path([reference], new, w.infer_rows, w.budget)
        # today's PolicyLoss asked for the entropy always; the new one only for a bonus or the metric
        loss = PolicyLoss(clip_eps=0.2, kl_coef=0.04, kl_estimator="k3", tis_cap=2.0, log_entropy=not new)
        out[prefix + "logprob_s"], out[prefix + "logprob_peak_gib"] = time_logprobs(policy, reference, batch, steps,
                                                                                    device)
        seconds, peak, metrics = time_train(policy, batch, loss, steps, device)
        out[prefix + "train_s"], out[prefix + "train_peak_gib"] = seconds, peak
        out[prefix + "micro_batches"] = metrics["micro_batches"]
        out[prefix + "loss"] = metrics["loss"]
    mask = batch["response_mask"]
    out["max_abs_logprob_diff"] = float(((logprobs[True] - logprobs[False]) * mask).abs().max())
    out["train_speedup"] = out["baseline_train_s"] / out["train_s"]
    out["logprob_speedup"] = out["baseline_logprob_s"] / out["logprob_s"]
    out["budget"], out["rows"], out["rows_cap"] = w.budget, w.rows, w.rows_cap
    return out


def build(model: str, device: str, dtype: str, mixed: bool = False, compile: bool = False
          ) -> tuple[HFTrainEngine, HFInferEngine]:
    """The policy's train engine (pure bf16 unless ``mixed``: fp32 masters under bf16 autocast)
    and the reference, with the defaults (packing, chunks; ``compile``: compiled decoder layers);
    each remembers the path it chose so ``use_path`` can switch back to it."""
    policy = HFTrainEngine(EngineSpec(model, device=device, seed=0, total_steps=100, options={
        "dtype": dtype, "lr": 1e-6, "mixed_precision": mixed, "compile": compile}))
    reference = HFInferEngine(EngineSpec(model, device=device, options={"dtype": dtype, "compile": compile}))
    for e in (policy, reference):
        e.hf_path, e.hf_chunk = e.hf.attention_path, e.hf.logprob_chunk
    return policy, reference


def mixed_precision(model: str, device: str, dtype: str, w: Workload, steps: int, vocab: int) -> dict[str, Any]:
    """W's train step (new path) with mixed precision, the GPU default: bf16 weights, fp32 masters
    (``run_workload`` measures pure bf16 weights and optimizer states): time and peak memory."""
    _reset(device)
    policy, _ = build(model, device, dtype, mixed=True)
    batch = make_batch(w, vocab)
    use_path([policy], True, w.rows_cap, w.budget)
    seconds, peak, metrics = time_train(policy, batch, w_loss(), steps, device)
    return {"enabled": policy.mixed_precision, "train_s": seconds, "train_peak_gib": peak, "loss": metrics["loss"]}


def w_loss() -> PolicyLoss:
    """W's loss on the new path (entropy only if asked for)."""
    return PolicyLoss(clip_eps=0.2, kl_coef=0.04, kl_estimator="k3", tis_cap=2.0)


def measure(policy: HFTrainEngine, reference: HFInferEngine, batch: Batch, steps: int, device: str, label: str
            ) -> dict[str, Any]:
    """The logprob phase and the train step on the engines' current paths: seconds, peaks, the
    micro-batch count and the last loss; printed under ``label``."""
    lp_s, lp_peak = time_logprobs(policy, reference, batch, steps, device)
    tr_s, tr_peak, metrics = time_train(policy, batch, w_loss(), steps, device)
    print(f"{label}: train {tr_s:.3f} s, logprob {lp_s:.3f} s, peak {tr_peak} GiB, "
          f"{metrics['micro_batches']:.0f} micro-batches", flush=True)
    return {"train_s": tr_s, "logprob_s": lp_s, "train_peak_gib": tr_peak, "logprob_peak_gib": lp_peak,
            "micro_batches": metrics["micro_batches"], "loss": metrics["loss"]}


def variants(policy: HFTrainEngine, reference: HFInferEngine, w: Workload, steps: int, device: str,
             vocab: int) -> list[dict[str, Any]]:
    """W's train step and logprob phase on variations of the new path, back to back on the same
    engines: token budgets, the full-vocabulary head with packing, the chunked head on padded rows."""
    batch = make_batch(w, vocab)
    out = []
    for name, packed, chunked, budget, rows in [("packed budget 12288, 64 rows", True, True, 12288, 64),
                                                ("packed budget 18432, 64 rows", True, True, 18432, 64),
                                                ("packed, full logits", True, False, w.budget, w.rows_cap),
                                                ("padded, chunked head", False, True, None, w.rows)]:
        use_path([policy], packed, rows, budget, chunked)
        use_path([reference], packed, w.infer_rows, budget, chunked)
        out.append({"variant": name, **measure(policy, reference, batch, steps, device, f"variant {name}")})
    # the logprob phase alone in larger micro-batches (no activations kept): the policy's infer_* options
    use_path([policy], True, w.rows_cap, w.budget)
    use_path([reference], True, 64, 18432)
    policy.options.infer_micro_batch_size, policy.options.infer_max_tokens_per_micro_batch = 64, 18432
    lp_s, lp_peak = time_logprobs(policy, reference, batch, steps, device)
    policy.options.infer_micro_batch_size = policy.options.infer_max_tokens_per_micro_batch = None
    out.append({"variant": "logprobs in micro-batches of 18432 tokens, 64 rows", "train_s": None, "logprob_s": lp_s,
                "train_peak_gib": None, "logprob_peak_gib": lp_peak, "micro_batches": None})
    print(f"variant logprobs 18432 x 64: logprob {lp_s:.3f} s, peak {lp_peak} GiB", flush=True)
    return out


def compiled(model: str, device: str, dtype: str, w: Workload, steps: int, vocab: int) -> dict[str, Any]:
    """W's train step and logprob phase with ``compile: true`` (the decoder layers compiled, new
    path) at W's budget and at 12,288 tokens x 64 rows; the first step and logprob phase (which
    compile) timed apart."""
    _reset(device)
    policy, reference = build(model, device, dtype, compile=True)
    batch = make_batch(w, vocab)
    inputs = batch.select("input_ids", "attention_mask", "response_mask")
    use_path([policy], True, w.rows_cap, w.budget)
    use_path([reference], True, w.infer_rows, w.budget)
    t0 = time.perf_counter()
    policy.train_step(batch, w_loss())
    policy.infer(inputs)
    reference.infer(inputs)
    _sync(device)
    out: dict[str, Any] = {"first_call_s": time.perf_counter() - t0}
    for name, budget, rows in [("budget", w.budget, w.rows_cap), ("budget 12288, 64 rows", 12288, 64)]:
        use_path([policy], True, rows, budget)
        use_path([reference], True, w.infer_rows, budget)
        out[name] = measure(policy, reference, batch, steps, device, f"compiled, {name}")
    return out


def profile(policy: HFTrainEngine, w: Workload, device: str, vocab: int, out_dir: str) -> dict[str, Any]:
    """One train step of the new and of the old path under torch's profiler: the device's busy
    time against the wall, and the kernels and host ops that take the most (``profile_*.txt``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch = make_batch(w, vocab)
    result = {}
    for new in (True, False):
        use_path([policy], new, w.rows_cap if new else w.rows, w.budget)
        loss = PolicyLoss(clip_eps=0.2, kl_coef=0.04, kl_estimator="k3", tis_cap=2.0, log_entropy=not new)
        policy.train_step(batch, loss)
        _sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        t0 = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            policy.train_step(batch, loss)
            _sync(device)
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        name = "new" if new else "old"
        sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        text = events.table(sort_by=sort, row_limit=40)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"profile_{name}.txt").write_text(text)
        result[name] = {"wall_s": wall, "device_busy_s": kernel_us / 1e6, "busy_fraction": kernel_us / 1e6 / wall}
        print(f"profile {name}: wall {wall:.3f} s, kernels {kernel_us / 1e6:.3f} s\n{text[:6000]}", flush=True)
    return result


# -- issue 25: precision x token budgets (x compile), the logprob phase without the old forward ------
PRECISIONS = {"autocast": "fp32 weights under bf16 autocast (before issue 25)",
              "mixed": "bf16 weights, fp32 masters (mixed_precision: true, the GPU default)",
              "bf16": "pure bf16 (mixed_precision: false)"}
W_BUDGETS = {"policy": {"micro_batch_size": 32, "max_tokens_per_micro_batch": 6144, "infer_micro_batch_size": 64,
                        "infer_max_tokens_per_micro_batch": 16384},
             "reference": {"micro_batch_size": 64, "max_tokens_per_micro_batch": 16384}}
"""W's hand-set micro-batches before issue 25 (configs/gpu/grpo_w.yaml)."""
SMOKE_BUDGETS = {"policy": {"micro_batch_size": 4, "max_tokens_per_micro_batch": 48, "infer_micro_batch_size": 8,
                            "infer_max_tokens_per_micro_batch": 96},
                 "reference": {"micro_batch_size": 8, "max_tokens_per_micro_batch": 96}}
_BUDGET_FIELDS = ("max_tokens_per_micro_batch", "infer_micro_batch_size", "infer_max_tokens_per_micro_batch")


def as_before_issue_25(policy: HFTrainEngine) -> None:
    """Mixed precision as it was built before issue 25, on an fp32 engine: every forward under
    bf16 autocast (each weight cast per micro-batch, the residual stream fp32, q/k reaching the
    attention in fp32) and torch's default AdamW (not fused) over the fp32 weights."""
    forward = policy.hf.forward

    def autocast_forward(batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None):
        with torch.autocast(policy.hf.device.type, dtype=torch.bfloat16):
            return forward(batch, need_entropy, gather)

    policy.hf.forward = autocast_forward
    o = policy.options
    policy.optimizer = torch.optim.AdamW(policy.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                         weight_decay=o.weight_decay)
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)


def precision_policy(model: str, device: str, precision: str, compile: bool = False) -> HFTrainEngine:
    """W's policy engine in one of ``PRECISIONS``."""
    policy = HFTrainEngine(EngineSpec(model, device=device, seed=0, total_steps=100, options={
        "dtype": "float32" if precision == "autocast" else "bfloat16", "lr": 1e-6,
        "mixed_precision": precision == "mixed", "compile": compile}))
    if precision == "autocast":
        as_before_issue_25(policy)
    return policy


def set_budgets(engine: Any, fields: dict[str, int] | None, rows: int) -> None:
    """Micro-batches of ``fields`` (W's hand-set ones), or none set (``None``): then a GPU derives
    the budgets (``engines.budget``) and a CPU cuts ``rows`` rows."""
    o = engine.options
    o.micro_batch_size = rows
    for k in _BUDGET_FIELDS:
        if k in type(o).model_fields:
            setattr(o, k, None)
    for k, v in (fields or {}).items():
        setattr(o, k, v)


KERNEL_KINDS = (("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas")), ("attention", ("flash", "fmha", "attention")),
                ("optimizer", ("adam", "multi_tensor", "foreach")), ("triton (compiled)", ("triton_",)))
"""Kernel name fragments by kind, for where a step's GPU time goes (the rest: ``elementwise/other``)."""


def kernel_kinds(events: Any) -> dict[str, float]:
    """Seconds of CUDA kernel time per kind of ``KERNEL_KINDS`` in a profiler's ``key_averages()``."""
    kinds: dict[str, float] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.key.lower()
        kind = next((k for k, parts in KERNEL_KINDS if any(p in name for p in parts)), "elementwise/other")
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e6
    return {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}


def gpu_busy(call, device: str, table: Path | None = None) -> float | None:
    """The fraction of ``call()``'s wall time the GPU ran kernels (torch's profiler, CUDA activity
    only: kernel times summed); ``None`` off a GPU. With ``table``, the 40 kernels that took the
    most and the time per kind of kernel (``kernel_kinds``) are written there."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    if table is not None:
        table.parent.mkdir(parents=True, exist_ok=True)
        kinds = kernel_kinds(events)
        table.write_text(f"wall {wall:.3f} s, kernels {kernel_us / 1e6:.3f} s, by kind {kinds}\n\n"
                         + events.table(sort_by="self_cuda_time_total", row_limit=40))
        print(f"{table.name}: wall {wall:.3f} s, kernels {kernel_us / 1e6:.3f} s, by kind {kinds}", flush=True)
    return kernel_us / 1e6 / wall


def measure_variant(label: str, policy: HFTrainEngine, reference: HFInferEngine, batch: Batch, steps: int,
                    device: str, busy: bool, tables: str | None = None) -> dict[str, Any]:
    """One row of the matrix: the logprob phase with the old-logprob forward (policy + reference)
    and without it (the reference alone: ``reuses_train_forward``), the train step with W's loss
    as W now runs it (``on_policy``: the old logprobs are the train forward's own), peaks, GPU busy."""
    from xrlhf.engines.hf import attention

    attention.TAKEN.clear()
    inputs = batch.select("input_ids", "attention_mask", "response_mask")
    loss = PolicyLoss(clip_eps=0.2, kl_coef=0.04, kl_estimator="k3", tis_cap=2.0, on_policy=True)
    infer_s, infer_peak = time_logprobs(policy, reference, batch, steps, device)
    ref_s = timed(lambda: reference.infer(inputs), steps, device)
    train_s, train_peak, metrics = time_train(policy, batch, loss, steps, device)
    tokens = int(batch["attention_mask"].sum())
    row = {"variant": label, "train_s": train_s, "infer_s": infer_s, "infer_s_without_old_logprobs": ref_s,
           "peak_gib": train_peak, "infer_peak_gib": infer_peak, "tokens_per_s": tokens / train_s,
           "gpu_busy": gpu_busy(lambda: policy.train_step(batch, loss), device, _table(tables, label, "train"))
           if busy else None,
           "gpu_busy_infer": gpu_busy(lambda: (policy.infer(inputs), reference.infer(inputs)), device,
                                      _table(tables, label, "infer")) if busy else None,
           "micro_batches": metrics["micro_batches"], "train_budget": policy.micro_batch_limits(False)[1],
           "infer_budget": policy.micro_batch_limits(True)[1], "reference_budget": reference.micro_batch_limits(True)[1],
           "loss": metrics["loss"], "attention": sorted(attention.TAKEN)}
    print(f"{label}: train {train_s:.3f} s ({metrics['micro_batches']:.0f} micro-batches), logprobs {infer_s:.3f} s "
          f"({ref_s:.3f} s without the old forward), peak {train_peak} GiB, busy {row['gpu_busy']}, "
          f"{row['attention']}", flush=True)
    return row


def _table(tables: str | None, label: str, phase: str) -> Path | None:
    """Where ``gpu_busy`` writes the kernel table of ``label``'s ``phase`` (``None``: nowhere)."""
    return None if tables is None else Path(tables, f"kernels_{re.sub(r'[^a-z0-9]+', '_', label.lower())}_{phase}.txt")


def guarded(label: str, device: str, measure) -> dict[str, Any]:
    """``measure(label)``, or, where it runs out of GPU memory (a derived budget too large for what
    the estimate left out), a row that says so: one variant failing does not lose the others."""
    try:
        return measure(label)
    except torch.cuda.OutOfMemoryError as e:
        _reset(device)
        print(f"{label}: out of memory ({str(e)[:200]})", flush=True)
        return {"variant": label, "error": f"OutOfMemoryError: {str(e)[:300]}", "train_s": None, "infer_s": None,
                "infer_s_without_old_logprobs": None, "peak_gib": None, "tokens_per_s": None, "gpu_busy": None}


def timed(call, steps: int, device: str) -> float:
    """Seconds per ``call()`` after one warm-up call."""
    call()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        call()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def matrix(model: str, device: str, batch: Batch, steps: int, budgets: dict[str, dict[str, int]],
           compile: bool, tables: str | None = None) -> list[dict[str, Any]]:
    """W's train step and logprob phase for each of ``PRECISIONS`` with derived budgets and with
    W's hand-set ones (engines built once per precision, derived first: a budget is derived at
    first use); then, with ``compile``, the fastest of them again with compiled layers (its first
    step, which compiles, timed apart)."""
    rows: list[dict[str, Any]] = []
    reference = HFInferEngine(EngineSpec(model, device=device, options={"dtype": "bfloat16"}))
    for precision in PRECISIONS:
        _reset(device)
        policy = precision_policy(model, device, precision)
        for name, fields in (("derived", None), ("W", budgets)):
            set_budgets(policy, fields and fields["policy"], 8)
            set_budgets(reference, fields and fields["reference"], 32)
            row = guarded(f"{precision}, {name} budgets", device, lambda label: measure_variant(
                label, policy, reference, batch, steps, device, busy=name == "derived", tables=tables))
            rows.append({**row, "precision": precision, "budgets": name, "compile": False})
        del policy
        _reset(device)
    if compile:
        best = min((r for r in rows if "error" not in r),
                   key=lambda r: r["train_s"] + r["infer_s_without_old_logprobs"])
        row = guarded(f"{best['variant']}, compiled", device, lambda label: compiled_variant(
            label, model, device, best["precision"], budgets if best["budgets"] == "W" else None, batch, steps,
            tables))
        rows.append({**row, "precision": best["precision"], "budgets": best["budgets"], "compile": True})
    return rows


def compiled_variant(label: str, model: str, device: str, precision: str, fields: dict[str, dict[str, int]] | None,
                     batch: Batch, steps: int, tables: str | None = None, head: bool = True) -> dict[str, Any]:
    """``measure_variant`` with compiled layers (policy and reference); the first train step and
    logprob phase, which compile, timed apart (``first_call_s``). ``head=False``: the logprob
    chunks eager (as before 2026-11-26's fifth session), the layers still compiled."""
    policy = precision_policy(model, device, precision, compile=True)
    reference = HFInferEngine(EngineSpec(model, device=device, options={"dtype": "bfloat16", "compile": True}))
    for engine in (policy, reference):
        engine.hf.head_compiled = engine.hf.head_compiled and head
    set_budgets(policy, fields and fields["policy"], 8)
    set_budgets(reference, fields and fields["reference"], 32)
    inputs = batch.select("input_ids", "attention_mask", "response_mask")
    t0 = time.perf_counter()
    policy.train_step(batch, w_loss())
    policy.infer(inputs)
    reference.infer(inputs)
    _sync(device)
    first = time.perf_counter() - t0
    return {**measure_variant(label, policy, reference, batch, steps, device, busy=True, tables=tables),
            "first_call_s": first}


def compiled_heads(model: str, device: str, batch: Batch, steps: int, tables: str | None) -> list[dict[str, Any]]:
    """``--compiled-only``: W's shipped train step and logprob phase (mixed precision, derived
    budgets, compiled layers) with the logprob chunks compiled, then eager: two rows."""
    rows = []
    for head in (True, False):
        label = f"mixed, derived budgets, compiled, head {'compiled' if head else 'eager'}"
        row = guarded(label, device, lambda label: compiled_variant(label, model, device, "mixed", None, batch, steps,
                                                                    tables, head=head))
        rows.append({**row, "precision": "mixed", "budgets": "derived", "compile": True, "head_compiled": head})
        _reset(device)
    return rows


def run_matrix(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """``--matrix``: ``matrix`` on W's shape (``--smoke``: a tiny model on the CPU), written to
    ``train_efficiency_matrix.json``."""
    if args.smoke:
        model = ensure_model(Path(tempfile.mkdtemp(prefix="xrlhf-eff-")) / "tiny", preset="tiny", dtype="float32")
        w, budgets, steps = SMOKE_W, SMOKE_BUDGETS, args.steps or 1
    else:
        model, w, budgets, steps = ensure_model(), W, W_BUDGETS, args.steps or 2
    from transformers import AutoConfig

    batch = make_batch(w, AutoConfig.from_pretrained(model).vocab_size)
    tables = str(Path(args.out, "kernels")) if args.profile else None
    rows = (compiled_heads(model, device, batch, steps, tables) if args.compiled_only
            else matrix(model, device, batch, steps, budgets, args.compile, tables))
    data = {"gpu": gpu_name(), "device": device, "model": model, "steps": steps, "sequences": w.sequences,
            "tokens": int(batch["attention_mask"].sum()), "precisions": PRECISIONS, "rows": rows,
            "targets": {"train_s": 1.0, "infer_s": 0.5, "gpu_busy": 0.8}}
    print(table([[r["variant"], r["train_s"], r["infer_s"], r["infer_s_without_old_logprobs"], r["peak_gib"],
                  r["tokens_per_s"], r["gpu_busy"], r.get("micro_batches")] for r in rows],
                ["variant", "train s", "logprobs s", "without old s", "peak GiB", "tokens/s", "busy", "micro-batches"]))
    write_json(args.out, "train_efficiency_matrix.json", data)
    return data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_step [efficiency]", description=__doc__.split("\n")[0],
                                 epilog="the other commands: sweep, ppo, deepspeed (python -m benchmarks.train_step COMMAND --help)")
    ap.add_argument("--out", default="benchmarks/results", help="directory of train_efficiency.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the script runs, in seconds")
    ap.add_argument("--steps", type=int, default=None, help="timed repetitions per path (default 3; smoke 1)")
    ap.add_argument("--budget", type=int, default=None, help="W's token budget of the new path (default 6144)")
    ap.add_argument("--variants", action="store_true", help="also W on variations of the new path (budgets, heads)")
    ap.add_argument("--profile", action="store_true", help="also one train step of each path under torch's profiler "
                    "(with --matrix: the kernel table of each measured train step and logprob phase, OUT/kernels/)")
    ap.add_argument("--compile", action="store_true", help="also W with compile: true (compiled decoder layers)")
    ap.add_argument("--compiled-only", action="store_true", help="with --matrix: only the shipped precision, compiled, "
                    "with the logprob chunks compiled and eager")
    ap.add_argument("--matrix", action="store_true", help="issue 25 only: precisions x budgets (x compile with "
                    "--compile), the logprob phase without the old forward; train_efficiency_matrix.json")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.matrix:
        return run_matrix(args, device)
    if args.smoke:
        model = ensure_model(Path(tempfile.mkdtemp(prefix="xrlhf-eff-")) / "tiny", preset="tiny", dtype="float32")
        workloads, dtype, steps = [SMOKE_W, SMOKE_LONG], "float32", args.steps or 1
    else:
        model, workloads, dtype, steps = ensure_model(), [W, LONG], "bfloat16", args.steps or 3
    if args.budget:
        workloads[0].budget = args.budget
    policy, reference = build(model, device, dtype)
    vocab = policy.hf.module.config.vocab_size
    results = {w.name: run_workload(w, policy, reference, steps, device, vocab) for w in workloads}
    main_w = results["W"]
    paths = {"attention_path": policy.hf_path, "logprob_chunk_tokens": policy.hf_chunk}
    if args.profile:
        main_w["profile"] = profile(policy, workloads[0], device, vocab, args.out)
    if args.variants:
        main_w["variants"] = variants(policy, reference, workloads[0], steps, device, vocab)
    del policy, reference
    results["W"]["mixed_precision"] = mixed_precision(model, device, dtype, workloads[0], steps, vocab)
    if args.compile:
        results["W"]["compiled"] = compiled(model, device, dtype, workloads[0], steps, vocab)
    data = {"gpu": gpu_name(), "device": device, "model": model, "dtype": dtype, "steps": steps,
            **paths,
            **{k: main_w[k] for k in ("train_s", "logprob_s", "train_peak_gib", "logprob_peak_gib", "baseline_train_s",
                                      "baseline_logprob_s", "baseline_train_peak_gib", "baseline_logprob_peak_gib")},
            "workload": main_w, "long": results["long"],
            "targets": {"train_s": 1.2, "logprob_s": 0.7, "train_peak_gib": 16.0}}
    rows = [[name, r["baseline_train_s"], r["train_s"], r["train_speedup"], r["baseline_logprob_s"], r["logprob_s"],
             r["logprob_speedup"], r["baseline_train_peak_gib"], r["train_peak_gib"], r["max_abs_logprob_diff"]]
            for name, r in results.items()]
    print(table(rows, ["workload", "train old s", "train new s", "x", "logprob old s", "logprob new s", "x",
                       "peak old GiB", "peak new GiB", "max |dlogp|"]))
    write_json(args.out, "train_efficiency.json", data)
    return data
