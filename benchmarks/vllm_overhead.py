"""Where vLLM's generation time goes on the 0.5B model, and what buys it back.

One ``VLLMGenerateEngine`` (the settings of ``generation.py``), then ``vllm.LLM.generate``
called directly with each way of asking for the sampled tokens' logprobs (none, vLLM's default
``list[dict[int, Logprob]]``, ``flat_logprobs``), with the Python garbage collector of the calling
process frozen or not, and at 64/128/256 prompts (time per decoding step against the batch: a
flat line means per-step host work, not the GPU, sets the pace). With ``--engines-per-gpu N``
(N > 1) it then starts N engines on the same GPU, each in its own process with 1/N of the
prompts and of the memory, and times them generating together (``--rounds K``: K times, the
median kept; ``--engines-per-gpu 1 2`` puts one engine's baseline in the same call).

    python -m benchmarks.vllm_overhead --out benchmarks/results --engines-per-gpu 2

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

from benchmarks.common import MODEL_05B, ensure_model, gpu_name, model_params, write_json
from benchmarks.generation import prompts_for, raw_vllm, timed, vllm_engine


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


def sweep(model: str, prompts: list[list[int]], new_tokens: int, memory: float) -> dict:
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


def worker(args) -> None:
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
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.vllm_overhead", "--worker", "--index", str(i),
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    args = p.parse_args()
    if args.worker:
        args.engines_per_gpu = args.engines_per_gpu[0]
        return worker(args)

    model = ensure_model(args.model or MODEL_05B)
    result = {"gpu": gpu_name(), "model_params": model_params(model), "prompts": args.prompts,
              "new_tokens": args.new_tokens}
    if not args.skip_sweep:
        result["one_engine"] = sweep(model, prompts_for(model, args.prompts), args.new_tokens, args.memory)
        write_json(args.out, "vllm_overhead.json", result)
    for n in args.engines_per_gpu:
        a = argparse.Namespace(**{**vars(args), "engines_per_gpu": n})
        result[f"engines_per_gpu_{n}"] = together(a)
        write_json(args.out, "vllm_overhead.json", result)


if __name__ == "__main__":
    main()
