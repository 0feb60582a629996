"""Generation throughput: the vLLM engine against the Transformers engine, same model and prompts.

Both are xrlhf's own ``GenerateEngine``s (so the numbers include what RL pays: per-token
logprobs), on the locally built 0.5B model in bfloat16, ``--prompts`` prompts of the reasoning
env each continued by exactly ``--new-tokens`` tokens (``ignore_eos``), temperature 1. Each
engine gets a short warm-up first; vLLM is shut down before the Transformers engine runs, which
is timed at each ``--hf-micro-batch`` (the fastest is compared). nvidia-smi samples how busy
the GPU is during each run.

    python -m benchmarks.generation_bench --breakdown --out benchmarks/results

writes ``generation.json`` (``generation-<preset>.json`` for another ``--preset``): gpu,
model_params, prompts, new_tokens, vllm_tokens_per_s, hf_tokens_per_s (and the seconds, the
speed-up, GPU utilisation, the settings; with ``--breakdown`` also ``vllm.LLM.generate`` called
directly with and without logprobs).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import (ROOT, DeviceMemorySampler, ensure_model, gpu_name, model_params, table,
                               vllm_options, write_json)


def prompts_for(model: str, n: int) -> list[list[int]]:
    from xrlhf.data.text import encode_prompt, load_tokenizer
    from xrlhf.envs import build_env

    tok = load_tokenizer(model)
    env = build_env("reasoning", {}, 0)
    return [encode_prompt(tok, p.text) for p in env.train_prompts(0, n)]


def timed(engine, prompts: list[list[int]], new_tokens: int, sampler=None, warm_up: bool = True) -> tuple[float, int]:
    """Seconds for one ``generate`` of every prompt (after a short untimed warm-up), and the tokens
    generated."""
    import torch

    from xrlhf.engines.base import SamplingParams

    if warm_up:
        engine.generate(prompts[:8], SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True))
        torch.cuda.synchronize()
    if sampler:
        sampler.reset()
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    tokens = sum(len(t) for t in out.token_ids)
    assert tokens == len(prompts) * new_tokens, (tokens, len(prompts), new_tokens)
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


def vllm_engine(model: str, prompts: int, memory: float, **engine_options):
    """The xrlhf vLLM engine of this benchmark (no sleep, ``max_num_seqs`` = the prompts) and its
    options; ``engine_options`` go to ``vllm.LLM`` as they are."""
    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.vllm import VLLMGenerateEngine

    options = vllm_options(gpu_memory_utilization=memory, sleep_level=0, max_num_seqs=prompts, max_model_len=1024,
                           engine_options=engine_options)
    return VLLMGenerateEngine(EngineSpec(model, device="cuda", options={**options, "dtype": "bfloat16"})), options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="0.5b", help="model preset (xrlhf.models.tiny.PRESETS): '0.5b' (the "
                   "reported figure) or '0.5b-gqa' (Qwen2.5-0.5B's grouped-query attention)")
    p.add_argument("--model", default=None, help="model directory (default: artifacts/model-<preset>, built if missing)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--hf-micro-batch", default="128,256",
                   help="the HF engine generates this many prompts at once (its logits of every step are kept); "
                        "a comma-separated list tries each and reports the fastest")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--engines", default="vllm,hf")
    p.add_argument("--breakdown", action="store_true",
                   help="also time vllm.LLM.generate directly, with and without logprobs")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    from xrlhf.engines.base import EngineSpec

    from transformers import AutoConfig

    model = ensure_model(args.model or ROOT / "artifacts" / f"model-{args.preset}", preset=args.preset)
    prompts = prompts_for(model, args.prompts)
    c = AutoConfig.from_pretrained(model)
    result = {"gpu": gpu_name(), "model_params": model_params(model), "prompts": args.prompts,
              "new_tokens": args.new_tokens, "dtype": "bfloat16", "vllm_tokens_per_s": None, "hf_tokens_per_s": None,
              "model_preset": args.preset, "model_shape": {k: getattr(c, k) for k in (
                  "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size")}}
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
        import gc

        import torch

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
    sampler.close()
    if result["vllm_tokens_per_s"] and result["hf_tokens_per_s"]:
        result["speedup"] = result["vllm_tokens_per_s"] / result["hf_tokens_per_s"]
    write_json(args.out, "generation.json" if args.preset == "0.5b" else f"generation-{args.preset}.json", result)
    rows = [(e, result.get(f"{e}_seconds"), result.get(f"{e}_tokens_per_s")) for e in ("vllm", "hf")]
    print(table(rows, ["engine", "seconds", "tokens/s"]))
    print(f"{result['gpu']}, {result['model_params']:,} params, {args.prompts} prompts x {args.new_tokens} tokens; "
          f"speed-up {result.get('speedup', float('nan')):.1f}x (target >= 10x)")


if __name__ == "__main__":
    main()
