"""Generation throughput: the vLLM engine against the Transformers engine, same model and prompts.

Both are xrlhf's own ``GenerateEngine``s (so the numbers include what RL pays: per-token
logprobs), on the locally built 0.5B model in bfloat16, ``--prompts`` prompts of the reasoning
env each continued by exactly ``--new-tokens`` tokens (``ignore_eos``), temperature 1. Each
engine gets a short warm-up first; vLLM is shut down before the Transformers engine runs, which
is timed at each ``--hf-micro-batch`` (the fastest is compared). nvidia-smi samples how busy
the GPU is during each run.

    python -m benchmarks.generation --breakdown --out benchmarks/results

writes ``generation.json`` (``generation-<preset>.json`` for another ``--preset``): gpu,
model_params, prompts, new_tokens, vllm_tokens_per_s, hf_tokens_per_s (and the seconds, the
speed-up, GPU utilisation, the settings; with ``--breakdown`` also ``vllm.LLM.generate`` called
directly with and without logprobs).

**Configurations and variants** (issue 25): ``--configs`` names vLLM engine configurations (JSON:
name -> ``policy.generate`` options over this benchmark's), built one after the other, each in a
process of its own (``--passes N``: the list N times over, A B A B); each runs ``--variants``
(``VARIANTS`` below) back to back on the same engine, so they compare on one start-up. On
workload W's shape::

    python -m benchmarks.generation --engines vllm --prompts 512 --new-tokens 256 \
        --configs '{"w": {"sleep_level": 2, "gpu_memory_utilization": 0.3}}' \
        --variants raw_no_logprobs,raw_logprobs,engine_logprobs,engine_no_logprobs,worker_logprobs \
        --rounds 5 --name main --out benchmarks/results

writes ``generation-<name>.json`` after every variant: per configuration its start-up seconds and
per variant seconds, tokens/s, ms per decoding step and the GPU's utilisation.

**Rounds.** One generate on the GPU varies by tens of percent from call to call (the host sets
the pace: 2.3-3.4 s for the same call), so one sample per variant compares noise. ``--rounds N``
runs the variants N times interleaved (round 1: each variant once, in ``--variants``' order;
round 2: again ...) on the same engine; each variant reports the figures of its median round
(by seconds; the lower of the two middle ones for an even N), plus ``rounds`` (every round's
figures), ``median_s``, ``min_s`` and ``max_s``. An odd N gives a median that is a real round.

**Logprobs path.** Every variant sets it before it runs: ``worker_*`` on the worker path (vLLM's
sampler records, ``internals/vllm_record.py``), every other on vLLM's outputs with vLLM's sampler
as its own (the recording turned off: ``xrlhf_record_logprobs(False)``), whatever the
configuration's ``logprobs_path`` (whose default, ``worker``, installs the recording at
start-up). So the variants run in the order given, ``worker_*`` no longer last, with any N.

**Overhead** (``overhead``): where vLLM's generation time goes on the 0.5B model, and what buys it
back. One ``VLLMGenerateEngine`` (the settings above), then ``vllm.LLM.generate``
called directly with each way of asking for the sampled tokens' logprobs (none, vLLM's default
``list[dict[int, Logprob]]``, ``flat_logprobs``), with the Python garbage collector of the calling
process frozen or not, and at 64/128/256 prompts (time per decoding step against the batch: a
flat line means per-step host work, not the GPU, sets the pace). With ``--engines-per-gpu N``
(N > 1) it then starts N engines on the same GPU, each in its own process with 1/N of the
prompts and of the memory, and times them generating together (``--rounds K``: K times, the
median kept; ``--engines-per-gpu 1 2`` puts one engine's baseline in the same call).

    python -m benchmarks.generation overhead --out benchmarks/results --engines-per-gpu 2

writes ``vllm_overhead.json``. ``--engine-options`` (JSON, ``VLLMOptions`` fields) sets the engines
of ``--engines-per-gpu`` (W's, so that they find the compile cache that a run of W filled).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import (MODEL_05B, ROOT, DeviceMemorySampler, ensure_model, gpu_name, model_params, table,
                               vllm_options, write_json)


def prompts_for(model: str, n: int, samples_per_prompt: int = 1) -> list[list[int]]:
    """``n`` prompts of the reasoning env, each of ``n / samples_per_prompt`` distinct ones repeated
    ``samples_per_prompt`` times in a row (as GRPO's groups: W has 64 x 8)."""
    from xrlhf.data.text import encode_prompt, load_tokenizer
    from xrlhf.envs import build_env

    tok = load_tokenizer(model)
    env = build_env("reasoning", {}, 0)
    distinct = [encode_prompt(tok, p.text) for p in env.train_prompts(0, -(-n // samples_per_prompt))]
    return [p for p in distinct for _ in range(samples_per_prompt)][:n]


def timed(engine, prompts: list[list[int]], new_tokens: int, sampler=None, warm_up: bool = True,
          logprobs: bool = True, seeds: list[int] | None = None) -> tuple[float, int]:
    """Seconds for one ``generate`` of every prompt (after a short untimed warm-up), and the tokens
    generated. ``logprobs``, ``seeds``: as ``SamplingParams.logprobs`` and ``generate``'s."""
    import torch

    from xrlhf.engines.base import SamplingParams

    if warm_up:
        engine.generate(prompts[:8], SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True))
        torch.cuda.synchronize()
    if sampler:
        sampler.reset()
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=logprobs)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, seeds)
    seconds = time.perf_counter() - t0
    tokens = sum(len(t) for t in out.token_ids)
    assert tokens == len(prompts) * new_tokens, (tokens, len(prompts), new_tokens)
    if logprobs:  # the logprobs are really there, one per token, and finite
        assert [len(lp) for lp in out.logprobs] == [len(t) for t in out.token_ids]
        assert all(-1e4 < x <= 0 for lp in out.logprobs[:4] for x in lp)
    else:
        assert out.logprobs == []
    return seconds, tokens


def raw_vllm(llm, prompts: list[list[int]], new_tokens: int, logprobs: int | None, sampler=None,
             flat: bool = True) -> dict:
    """``vllm.LLM.generate`` called directly (no xrlhf code around it), with or without the sampled
    tokens' logprobs (``flat``: as ``FlatLogprobs``): seconds, tokens/s, ms per decoding step and,
    with a ``sampler``, the GPU's mean utilisation. Where the engine's time goes."""
    from vllm import SamplingParams as VSamplingParams
    from vllm import TokensPrompt

    sp = VSamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs, detokenize=False,
                         flat_logprobs=flat)
    if sampler:
        sampler.reset()
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * new_tokens, tokens
    if logprobs is not None:  # the logprobs are really there
        assert len(outs[0].outputs[0].logprobs) == new_tokens
    return {"seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
            "ms_per_step": round(1000 * seconds / new_tokens, 2),
            "gpu_utilization": sampler.utilization() if sampler else None}


def vllm_engine(model: str, prompts: int, memory: float, **fields):
    """The xrlhf vLLM engine of this benchmark (no sleep, ``max_num_seqs`` = the prompts, bfloat16)
    and its options. ``fields``: ``VLLMOptions`` fields over those; any other key goes to
    ``vllm.LLM`` as it is (``engine_options``)."""
    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.vllm import VLLMGenerateEngine, VLLMOptions

    typed = {k: v for k, v in fields.items() if k in VLLMOptions.model_fields}
    extra = {k: v for k, v in fields.items() if k not in VLLMOptions.model_fields}
    base = dict(gpu_memory_utilization=memory, sleep_level=0, max_num_seqs=prompts, max_model_len=1024,
                dtype="bfloat16")
    options = vllm_options(**{**base, **typed, "engine_options": {**typed.get("engine_options", {}), **extra}})
    return VLLMGenerateEngine(EngineSpec(model, device="cuda", options=options)), options


# -- configurations and variants (issue 25) --------------------------------------------------------
def _figures(seconds: float, tokens: int, new_tokens: int, sampler) -> dict[str, Any]:
    return {"seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
            "ms_per_step": round(1000 * seconds / new_tokens, 2),
            "gpu_utilization": sampler.utilization() if sampler else None}


def _engine_run(logprobs: bool = True, keyed: bool = False) -> Callable:
    def run(engine, prompts, new_tokens, sampler) -> dict[str, Any]:
        seeds = list(range(len(prompts))) if keyed else None
        seconds, tokens = timed(engine, prompts, new_tokens, sampler, warm_up=False, logprobs=logprobs, seeds=seeds)
        return _figures(seconds, tokens, new_tokens, sampler)
    return run


def _raw_run(logprobs: int | None) -> Callable:
    def run(engine, prompts, new_tokens, sampler) -> dict[str, Any]:
        return raw_vllm(engine.llm, prompts, new_tokens, logprobs, sampler)
    return run


def set_logprobs_path(engine, path: str) -> None:
    """``engine``'s logprobs from ``path``: ``"worker"`` (vLLM's sampler records them, ``internals/vllm_record.py``)
    or ``"outputs"`` (vLLM's sampler as its own again: ``raw_*`` is then vLLM alone). The engine
    records exactly when its option says ``"worker"`` (it installed the recording at start-up then)."""
    if engine.logprobs_path != path:
        with engine._loop.exclusive():  # not under a step of the request loop
            engine._rpc("xrlhf_record_logprobs", path == "worker")
        engine.logprobs_path = path


def _on(path: str, run: Callable) -> Callable:
    """``run`` with the engine's logprobs path set to ``path`` first (``set_logprobs_path``)."""
    def on_path(engine, prompts, new_tokens, sampler) -> dict[str, Any]:
        set_logprobs_path(engine, path)
        return run(engine, prompts, new_tokens, sampler)
    return on_path


def _worker(run: Callable) -> Callable:
    """``run`` with the logprobs kept in vLLM's worker (``logprobs_path: worker``)."""
    return _on("worker", run)


def _outputs(run: Callable) -> Callable:
    """``run`` with vLLM's own sampler (``logprobs_path: outputs``; logprobs, if asked, from vLLM's outputs)."""
    return _on("outputs", run)


_WEIGHTS: list = []


def _w_cycle(engine, prompts, new_tokens, sampler) -> dict[str, Any]:
    """W's generation as its step sees it: the engine slept (its ``sleep_level``), new weights
    loaded (the model's own, through the engine's weight path), woken, then one generate."""
    import torch
    from safetensors.torch import load_file

    if not _WEIGHTS:
        from pathlib import Path

        for f in sorted(Path(engine.spec.model_path).glob("*.safetensors")):
            _WEIGHTS.extend(load_file(str(f)).items())
    torch.cuda.synchronize()
    engine.sleep()
    t0 = time.perf_counter()
    engine.update_weights(_WEIGHTS)
    engine.end_sync(engine.version + 1)
    sync_s = time.perf_counter() - t0
    out = _engine_run()(engine, prompts, new_tokens, sampler)
    return {**out, "sync_s": round(sync_s, 3), "sleep_level": engine.sleep_level}


VARIANTS: dict[str, Callable] = {
    "raw_no_logprobs": _outputs(_raw_run(None)),
    "raw_logprobs": _outputs(_raw_run(0)),
    "engine_logprobs": _outputs(_engine_run()),
    "engine_no_logprobs": _outputs(_engine_run(logprobs=False)),
    "engine_keyed": _outputs(_engine_run(keyed=True)),
    "engine_keyed_no_logprobs": _outputs(_engine_run(logprobs=False, keyed=True)),
    "w_cycle": _outputs(_w_cycle),
    "worker_logprobs": _worker(_engine_run()),
    "worker_keyed": _worker(_engine_run(keyed=True)),
    "worker_w_cycle": _worker(_w_cycle),
}
"""What ``--variants`` may name; each sets its logprobs path first (module docstring)."""

VARIANT_NOTES = {
    "raw_no_logprobs": "`vllm.LLM.generate` alone, no logprobs (the floor)",
    "raw_logprobs": "`vllm.LLM.generate`, the sampled tokens' logprobs",
    "engine_logprobs": "xrlhf's generate, logprobs from vLLM's outputs",
    "engine_no_logprobs": "xrlhf's generate, no logprobs",
    "engine_keyed": "xrlhf's keyed generate (the request loop), logprobs from vLLM's outputs",
    "engine_keyed_no_logprobs": "xrlhf's keyed generate, no logprobs",
    "w_cycle": "sleep, new weights, wake, generate (logprobs from vLLM's outputs)",
    "worker_logprobs": "xrlhf's generate, logprobs kept in vLLM's worker",
    "worker_keyed": "xrlhf's keyed generate, logprobs kept in vLLM's worker (how a rollout samples)",
    "worker_w_cycle": "sleep, new weights, wake, generate (logprobs kept in vLLM's worker: a step's cycle)",
}
"""Each variant in words, as docs/benchmarks.md's tables name it."""


def interleaved(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, variant)`` in the order they run: every variant of ``names`` once per round."""
    return [(r, v) for r in range(1, rounds + 1) for v in names]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's entry from its rounds' figures (each with ``seconds``): the median round's
    figures (the lower middle one for an even count), ``rounds`` and the seconds' median, min, max."""
    seconds = [r["seconds"] for r in rounds]
    middle = statistics.median_low(seconds)
    median_round = next(r for r in rounds if r["seconds"] == middle)
    return {**median_round, "rounds": list(rounds), "median_s": round(statistics.median(seconds), 3),
            "min_s": min(seconds), "max_s": max(seconds)}


def run_configs(args, model: str, prompts: list[list[int]], result: dict[str, Any]) -> None:
    """Each configuration of ``--configs`` in turn, ``--passes`` times in alternation (A B A B ...),
    each engine in a process of its own (vLLM's sleep mode takes one engine per process): start it
    (timed), warm it up, run the variants ``--rounds`` times interleaved. A variant's figures pool
    its rounds over the passes; ``result`` is written after every round (a cut-off run keeps what
    it measured)."""
    import multiprocessing

    names = [v for v in args.variants.split(",") if v]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.rounds < 1 or args.passes < 1:
        raise SystemExit(f"--rounds and --passes: at least 1, got {args.rounds} and {args.passes}")
    path, failed = Path(args.out) / f"generation-{args.name}.json", []
    path.unlink(missing_ok=True)  # read back after each pass: an older run's must not be
    for n in range(1, args.passes + 1):
        for config, fields in json.loads(args.configs).items():
            child = multiprocessing.get_context("spawn").Process(  # not a pool's daemon: vLLM may start processes
                target=config_pass, args=(args, model, prompts, config, fields, result, n))
            child.start()
            child.join()
            if path.is_file():  # what the pass wrote, round by round
                result.update(json.loads(path.read_text()))
            if child.exitcode:
                failed.append(f"{config} pass {n} (exit {child.exitcode})")
    if failed:
        raise SystemExit(f"generation: failed: {', '.join(failed)}; the others' figures are in {path}")


def config_pass(args, model: str, prompts: list[list[int]], config: str, fields: dict[str, Any],
                result: dict[str, Any], n: int) -> None:
    """Pass ``n`` of one configuration (``run_configs``), in a process of its own: this pass's
    rounds added to the configuration's entry of ``result``, written after each."""
    import torch

    from xrlhf.engines.base import SamplingParams

    names = [v for v in args.variants.split(",") if v]
    sampler = DeviceMemorySampler()
    t0 = time.perf_counter()
    engine, options = vllm_engine(model, len(prompts), args.gpu_memory_utilization, **fields)
    entry = result["configs"].setdefault(config, {"variants": {}, "startup_s_passes": [], "options": {
        k: v for k, v in options.items() if k in fields or k == "engine_options"}})
    entry["startup_s_passes"].append(round(time.perf_counter() - t0, 1))
    entry["startup_s"] = round(statistics.median(entry["startup_s_passes"]), 1)
    print(f"{config} pass {n}: engine ready in {entry['startup_s_passes'][-1]} s", flush=True)
    engine.generate(prompts[:64], SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True))
    torch.cuda.synchronize()
    measured = {v: list(entry["variants"].get(v, {}).get("rounds", [])) for v in names}
    for r, v in interleaved(names, args.rounds):
        measured[v].append({**VARIANTS[v](engine, prompts, args.new_tokens, sampler), "pass": n})
        entry["variants"][v] = summarize(measured[v])
        print(f"{config} pass {n} {v} round {r}/{args.rounds}: {measured[v][-1]}", flush=True)
        write_json(args.out, f"generation-{args.name}.json", result)
    engine.shutdown()
    sampler.close()


def run_hf(args, model: str, prompts: list[list[int]], sampler, result: dict[str, Any]) -> None:
    """The Transformers engine at each ``--hf-micro-batch``; the fastest goes into ``result``."""
    import gc

    import torch

    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.hf import HFGenerateEngine

    tried = {}
    for mb in map(int, str(args.hf_micro_batch).split(",")):
        engine = HFGenerateEngine(EngineSpec(model, device="cuda", options={"micro_batch_size": mb, "dtype": "bfloat16"}))
        seconds, tokens = timed(engine, prompts, args.new_tokens, sampler)
        tried[mb] = dict(hf_seconds=seconds, hf_tokens_per_s=tokens / seconds, hf_micro_batch_size=mb,
                         hf_gpu_utilization=sampler.utilization())
        print(f"hf micro-batch {mb}: {tokens / seconds:.0f} tokens/s", flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    result.update(max(tried.values(), key=lambda r: r["hf_tokens_per_s"]))
    result["hf_tokens_per_s_by_micro_batch"] = {mb: round(r["hf_tokens_per_s"]) for mb, r in tried.items()}


def engines(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation",
                                description="Generation throughput: the vLLM engine against the Transformers engine "
                                "(``overhead ...``: where vLLM's time goes, engines per GPU)")
    p.add_argument("--preset", default="0.5b", help="model preset (xrlhf.models.tiny.PRESETS): '0.5b' (the "
                   "reported figure) or '0.5b-gqa' (Qwen2.5-0.5B's grouped-query attention)")
    p.add_argument("--model", default=None, help="model directory (default: artifacts/model-<preset>, built if missing)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--samples-per-prompt", type=int, default=1, help="each distinct prompt this many times in a row")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--hf-micro-batch", default="128,256",
                   help="the HF engine generates this many prompts at once (its logits of every step are kept); "
                        "a comma-separated list tries each and reports the fastest")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--engines", default="vllm,hf")
    p.add_argument("--breakdown", action="store_true",
                   help="also time vllm.LLM.generate directly, with and without logprobs")
    p.add_argument("--configs", default=None, help="JSON: configuration name -> vLLM engine options (VLLMOptions "
                   "fields; other keys go to vllm.LLM); each runs --variants, and nothing else runs")
    p.add_argument("--variants", default="raw_no_logprobs,raw_logprobs,engine_logprobs,engine_no_logprobs,"
                   "worker_logprobs", help=f"with --configs, any of: {', '.join(VARIANTS)}")
    p.add_argument("--name", default="configs", help="with --configs: the JSON is generation-<name>.json")
    p.add_argument("--rounds", type=int, default=1, help="with --configs: run the variants this many times, "
                   "interleaved, in one engine; each reports its median round (odd counts give a real median)")
    p.add_argument("--passes", type=int, default=1, help="with --configs: run the configurations this many times in "
                   "alternation (A B A B: one engine's start-up and the machine's drift fall on each)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    from transformers import AutoConfig

    model = ensure_model(args.model or ROOT / "artifacts" / f"model-{args.preset}", preset=args.preset)
    prompts = prompts_for(model, args.prompts, args.samples_per_prompt)
    c = AutoConfig.from_pretrained(model)
    result = {"gpu": gpu_name(), "model_params": model_params(model), "prompts": args.prompts,
              "samples_per_prompt": args.samples_per_prompt, "new_tokens": args.new_tokens, "dtype": "bfloat16", "vllm_tokens_per_s": None, "hf_tokens_per_s": None,
              "model_preset": args.preset, "model_shape": {k: getattr(c, k) for k in (
                  "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size")}}
    if args.configs:
        result["configs"] = {}
        run_configs(args, model, prompts, result)
        print(table([(c, v, r["median_s"], r["tokens_per_s"], r["min_s"], r["max_s"], len(r["rounds"]))
                     for c, e in result["configs"].items() for v, r in e["variants"].items()],
                    ["config", "variant", "median s", "tokens/s (median round)", "min s", "max s", "rounds"]))
        return
    sampler = DeviceMemorySampler()
    if "vllm" in args.engines:
        t0 = time.perf_counter()
        engine, options = vllm_engine(model, args.prompts, args.gpu_memory_utilization)
        result["vllm_startup_s"] = round(time.perf_counter() - t0, 1)
        seconds, tokens = timed(engine, prompts, args.new_tokens, sampler)
        result.update(vllm_seconds=seconds, vllm_tokens_per_s=tokens / seconds, vllm_gpu_utilization=sampler.utilization(),
                      vllm_options={k: options[k] for k in ("enforce_eager", "max_num_seqs", "engine_options")})
        if args.breakdown:
            for name, logprobs in (("logprobs", 0), ("no_logprobs", None)):
                raw = raw_vllm(engine.llm, prompts, args.new_tokens, logprobs, sampler)
                result[f"vllm_raw_{name}_tokens_per_s"] = raw["tokens_per_s"]
                result[f"vllm_raw_{name}_gpu_utilization"] = raw["gpu_utilization"]
        engine.shutdown()
        del engine
    if "hf" in args.engines:
        run_hf(args, model, prompts, sampler, result)
    sampler.close()
    if result["vllm_tokens_per_s"] and result["hf_tokens_per_s"]:
        result["speedup"] = result["vllm_tokens_per_s"] / result["hf_tokens_per_s"]
    write_json(args.out, "generation.json" if args.preset == "0.5b" else f"generation-{args.preset}.json", result)
    rows = [(e, result.get(f"{e}_seconds"), result.get(f"{e}_tokens_per_s")) for e in ("vllm", "hf")]
    print(table(rows, ["engine", "seconds", "tokens/s"]))
    print(f"{result['gpu']}, {result['model_params']:,} params, {args.prompts} prompts x {args.new_tokens} tokens; "
          f"speed-up {result.get('speedup', float('nan')):.1f}x (target >= 10x)")


# -- overhead: where vLLM's time goes, engines per GPU ----------------------------------------------
def raw(llm, prompts: list[list[int]], new_tokens: int, logprobs: int | None, flat: bool = False) -> dict:
    """``raw_vllm`` without the utilisation: seconds, tokens/s, ms per decoding step."""
    out = raw_vllm(llm, prompts, new_tokens, logprobs, flat=flat)
    out.pop("gpu_utilization")
    return out


def xrlhf_generate(eng, prompts: list[list[int]], new_tokens: int) -> dict:
    """One timed ``VLLMGenerateEngine.generate`` (the engine is already warm)."""
    seconds, tokens = timed(eng, prompts, new_tokens, warm_up=False)
    return {"seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds)}


@contextmanager
def frozen_gc(on: bool):
    """The caller's garbage collector frozen (existing objects never rescanned) and off."""
    if not on:
        yield
        return
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def overhead_sweep(model: str, prompts: list[list[int]], new_tokens: int, memory: float) -> dict:
    t0 = time.perf_counter()
    eng, _ = vllm_engine(model, len(prompts), memory)
    startup = round(time.perf_counter() - t0, 1)
    llm = eng.llm
    raw(llm, prompts[:8], 16, 0)  # warm-up
    runs: dict[str, dict] = {"xrlhf_engine": xrlhf_generate(eng, prompts, new_tokens)}
    for name, kw in [("logprobs_dict", dict(logprobs=0)), ("logprobs_flat", dict(logprobs=0, flat=True)),
                     ("no_logprobs", dict(logprobs=None))]:
        for frozen in (False, True):
            key = name + ("_gc_frozen" if frozen else "")
            with frozen_gc(frozen):
                runs[key] = raw(llm, prompts, new_tokens, **kw)
            print(key, runs[key], flush=True)
    with frozen_gc(True):
        runs["xrlhf_engine_gc_frozen"] = xrlhf_generate(eng, prompts, new_tokens)
    scaling = {}
    for n in (32, 64, 128, len(prompts)):
        scaling[n] = {lp: raw(llm, prompts[:n], new_tokens, 0 if lp == "logprobs" else None)["ms_per_step"]
                      for lp in ("logprobs", "no_logprobs")}
        print("batch", n, scaling[n], flush=True)
    eng.shutdown()
    return {"startup_s": startup, "runs": runs, "ms_per_step_by_batch": scaling}


def overhead_worker(args) -> None:
    """One of ``--engines-per-gpu`` engines: its slice of the prompts, timed after a shared start."""
    from transformers import AutoConfig

    model = ensure_model(args.model or MODEL_05B)
    prompts = prompts_for(model, args.prompts)[args.index::args.engines_per_gpu]
    c = AutoConfig.from_pretrained(model)
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    # a fixed KV cache: engines that start side by side would see each other in vLLM's memory profile
    fields = json.loads(args.engine_options) or {"kv_cache_memory_bytes": len(prompts) * 1024 * per_token}
    eng, _ = vllm_engine(model, len(prompts), args.memory / args.engines_per_gpu, **fields)
    raw(eng.llm, prompts[:8], 16, 0)
    sync = Path(args.sync_dir)
    (sync / f"ready-{args.index}").touch()
    results: dict[str, list[dict]] = {run: [] for run in RUNS}
    for r in range(args.rounds):
        for run in RUNS:
            go = sync / f"go-{run}-{r}"
            while not go.exists():
                time.sleep(0.01)
            t0 = time.time()
            if run == "xrlhf_engine":
                xrlhf_generate(eng, prompts, args.new_tokens)
            else:
                raw(eng.llm, prompts, args.new_tokens, None)
            results[run].append({"start": t0, "end": time.time(), "tokens": len(prompts) * args.new_tokens})
            (sync / f"done-{run}-{r}-{args.index}").touch()
    (sync / f"result-{args.index}.json").write_text(json.dumps(results))
    eng.shutdown()


def together(args) -> dict:
    """``--engines-per-gpu`` engine processes on this GPU, generating at the same time."""
    n = args.engines_per_gpu
    sync = Path(args.out) / f"sync-{n}"
    sync.mkdir(parents=True, exist_ok=True)
    for f in sync.iterdir():
        f.unlink()
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.generation", "overhead", "--worker", "--index", str(i),
                               "--engines-per-gpu", str(n), "--sync-dir", str(sync), "--prompts", str(args.prompts),
                               "--new-tokens", str(args.new_tokens), "--memory", str(args.memory),
                               "--engine-options", args.engine_options, "--rounds", str(args.rounds)]
                              + (["--model", args.model] if args.model else []),
                              env={**os.environ, "VLLM_CACHE_ROOT": f"{os.environ.get('TMPDIR', '/tmp')}/vc-{n}-{i}"})
             for i in range(n)]

    def wait_for(names: list[str]) -> None:
        while not all((sync / x).exists() for x in names):
            if any(p.poll() not in (None, 0) for p in procs):
                raise SystemExit(f"an engine process failed: {[p.returncode for p in procs]}")
            time.sleep(0.05)

    wait_for([f"ready-{i}" for i in range(n)])
    startup = round(time.perf_counter() - t0, 1)
    out: dict = {"engines": n, "startup_s": startup}
    for r in range(args.rounds):  # the engines start each generate together, round by round
        for run in RUNS:
            (sync / f"go-{run}-{r}").touch()
            wait_for([f"done-{run}-{r}-{i}" for i in range(n)])
    for p in procs:
        p.wait(timeout=120)
    out.update(rounds_together([json.loads((sync / f"result-{i}.json").read_text()) for i in range(n)]))
    print(out, flush=True)
    return out


RUNS = ("xrlhf_engine", "no_logprobs")
"""What each engine times, in this order every round: its ``generate`` (W's path), then
``LLM.generate`` without logprobs."""


def rounds_together(results: list[dict[str, list[dict]]]) -> dict[str, dict]:
    """Per run, the rounds' wall time from the first engine's start to the last one's end: the
    median's seconds and tokens/s, each round's seconds. ``results``: per engine, per run, each
    round's ``start``, ``end`` (epoch s) and ``tokens``."""
    out = {}
    for run in RUNS:
        rounds = list(zip(*(r[run] for r in results)))  # round k: every engine's k-th generate
        seconds = [max(x["end"] for x in rnd) - min(x["start"] for x in rnd) for rnd in rounds]
        tokens = sum(x["tokens"] for x in rounds[0])
        med = statistics.median(seconds)
        out[run] = {"seconds": round(med, 3), "tokens_per_s": round(tokens / med),
                    "rounds_s": [round(x, 3) for x in seconds]}
    return out


def overhead(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation overhead",
                                description="Where vLLM's generation time goes, and what buys it back")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--memory", type=float, default=0.5, help="gpu_memory_utilization of all engines together")
    p.add_argument("--engines-per-gpu", type=int, nargs="*", default=[])
    p.add_argument("--rounds", type=int, default=1, help="generates per engine and run, their median reported "
                   "(one generate moved by up to 1.6x between steps on an H100)")
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--engine-options", default="{}", help="JSON: VLLMOptions fields of the --engines-per-gpu engines "
                   "(default: a KV cache of their prompts x 1024 tokens)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.engines_per_gpu = args.engines_per_gpu[0]
        return overhead_worker(args)

    model = ensure_model(args.model or MODEL_05B)
    result = {"gpu": gpu_name(), "model_params": model_params(model), "prompts": args.prompts,
              "new_tokens": args.new_tokens}
    if not args.skip_sweep:
        result["one_engine"] = overhead_sweep(model, prompts_for(model, args.prompts), args.new_tokens, args.memory)
        write_json(args.out, "vllm_overhead.json", result)
    for n in args.engines_per_gpu:
        a = argparse.Namespace(**{**vars(args), "engines_per_gpu": n})
        result[f"engines_per_gpu_{n}"] = together(a)
        write_json(args.out, "vllm_overhead.json", result)


def main(argv: list[str] | None = None) -> None:
    """``overhead ...``: where vLLM's time goes; anything else: the engines compared."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["overhead"]:
        return overhead(argv[1:])
    return engines(argv)


if __name__ == "__main__":
    main()
