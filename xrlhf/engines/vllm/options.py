"""Options of the vLLM generate engine (``policy.generate`` with ``engine: vllm``) and how they
become ``vllm.LLM``'s arguments and environment. Imports no vLLM: ``xrlhf validate`` reads these
without it. What each speed and start-up option does, with the vLLM source behind it (read in 0.25.1):
docs/design/generation-speed.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from xrlhf.config.schema import yaml_path
from xrlhf.engines.base import EngineSpec, GenerateOptions

EXTENSION = "xrlhf.engines.vllm.extension.XrlhfWorkerExtension"

ENV_DEFAULTS = {
    "VLLM_NO_USAGE_STATS": "1",  # the usage thread posts to stats.vllm.ai with no timeout
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # skips the 8.8.8.8 probe of get_ip(); one node only
    # vLLM's engine process: spawned rather than forked from a process whose threads (tokenizers,
    # OpenMP, CUDA) may hold locks the child inherits. vLLM forks by default, but where CUDA is
    # initialised it spawns anyway; spawning always makes the two cases one (docs/vllm.md).
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Set (unless already set) before vLLM is imported: no network on the way up."""


class VLLMOptions(GenerateOptions):
    """``policy.generate`` with ``engine: vllm``: the shared sampling fields plus these (docs/vllm.md)."""

    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per generator (tensor parallel)")
    gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="share of the GPU's total memory vLLM may "
                                          "use (weights, activations, CUDA graphs, KV cache)")
    enforce_eager: bool = Field(False, description="no torch.compile and no CUDA graphs")
    sleep_level: Literal[0, 1, 2] = Field(1, description="co-located: what is freed while training runs: 0 nothing, "
                                          "1 KV cache (weights to CPU), 2 KV cache and weights")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + response (default: the model's)")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences decoded at once (CUDA graph sizes)")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="more vllm.LLM arguments, passed as "
                                           "they are, and 'env': variables set before vLLM is imported")
    seeded_sampling: bool = Field(False, description="asynchronous rollout: give each request its sample seed, so a "
                                  "sample repeats from its seed. vLLM's V2 model runner (the default) seeds every "
                                  "request anyway (Gumbel noise from seed and position), so this costs nothing there; "
                                  "its V1 runner samples seeded rows one by one (a kernel per row and token). vLLM "
                                  "is not batch-invariant, so regeneration is 'same distribution', not bit-identical")
    logprobs_path: Literal["outputs", "worker"] = Field(
        "worker", description="how the sampled tokens' logprobs reach xrlhf: 'worker', computed by vLLM's own kernel "
        "in its worker, kept on the GPU and fetched once per call (needs vLLM's V2 model runner, its default; "
        "docs/benchmarks.md has what it saves); 'outputs', vLLM's per-token outputs (per request and step on the "
        "host; docs/design/generation-speed.md)")
    # -- speed (passed to vLLM as they are; null: vLLM's default) ----------------------------------
    async_scheduling: bool | None = Field(None, description="vLLM schedules step t+1 while the GPU runs step t "
                                          "(null: vLLM's default, on with xrlhf's executors)")
    enable_prefix_caching: bool | None = Field(
        None, description="share the KV blocks of common prompt prefixes (null: vLLM's default, on). Every full "
        "block of every request is hashed as it fills (host work); it pays when prompts share long prefixes")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per scheduler step (prefill chunks); "
                                               "null: vLLM's default (16384 on an H100 or H200)")
    cudagraph_capture_sizes: list[int] | Literal["rollout"] | None = Field(
        "rollout", min_length=1, description="decode batch sizes captured as CUDA graphs (a batch runs padded to "
        "the next one): 'rollout' (ours): 1, 2, 4, 8, 16, then x1.5 steps to 256 and every 64 above, up to "
        "max_num_seqs or 512 (17 sizes at 512: at most 50% padding below 256, 25% above, where decoding large "
        "batches is bound by the host or by reading the weights, not by the rows); null: vLLM's own, 1, 2, 4, then "
        "every 8 to 256 and every 16 above (51 sizes at max_num_seqs 512); or a list (sizes given in "
        "engine_options.compilation_config win). Each size costs start-up (docs/vllm.md)")
    # -- start-up --------------------------------------------------------------------------------
    torch_compile: bool = Field(False, description="vLLM compiles the model with torch.compile (true: vLLM's "
                                "default) or not (false, ours): the decode steps run as whole CUDA graphs either way "
                                "(FULL_DECODE_ONLY without compilation), so decoding gains nothing from it, while it "
                                "costs start-up (docs/vllm.md). Prefill-heavy batches (long prompts) run eager "
                                "without it: try true there")
    multiprocessing: bool = Field(False, description="vLLM's engine core in a process of its own (true: vLLM's "
                                  "default) or in the generator's process (false, ours: no process to spawn and "
                                  "import at start-up and no outputs sent between processes; docs/vllm.md). The "
                                  "generator is an actor of its own, so its host work shares no interpreter with a trainer either way")
    kv_cache_tokens: int | Literal["batch"] | None = Field(
        None, description="a KV cache of this many tokens ('batch': max_num_seqs x max_model_len), so vLLM skips "
        "measuring free GPU memory and the engine is built beside the other engines instead of last and alone; "
        "null: vLLM sizes it from gpu_memory_utilization (which then bounds all its memory; with kv_cache_tokens "
        "it is only the share vLLM checks is free when it starts)")
    compile_cache_dir: str | None = Field(None, description="vLLM's compile cache and Inductor's and Triton's "
                                          "caches under this directory (a second run there starts warm); null: "
                                          "their per-user defaults (~/.cache/vllm, ~/.triton)")

    @model_validator(mode="after")
    def _kv_cache_batch_needs_the_batch(self, info: ValidationInfo):
        if isinstance(self.kv_cache_tokens, int) and self.kv_cache_tokens < 1:
            raise ValueError(f"{yaml_path(info, 'policy.generate')}.kv_cache_tokens: give a positive number of "
                             f"tokens, 'batch' or null, got {self.kv_cache_tokens}")
        if self.kv_cache_tokens == "batch" and (self.max_num_seqs is None or self.max_model_len is None):
            raise ValueError(f"{yaml_path(info, 'policy.generate')}.kv_cache_tokens: 'batch' is max_num_seqs x "
                             f"max_model_len; set both, or give kv_cache_tokens as a number of tokens")
        return self


TYPED_OPTIONS = ("tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "max_model_len",
                 "max_num_seqs", "async_scheduling", "enable_prefix_caching", "max_num_batched_tokens")
"""``VLLMOptions`` fields passed to ``vllm.LLM`` under the same names (when not null)."""

KV_BLOCK_TOKENS = 16
"""vLLM's KV block on CUDA attention backends; a sequence wastes up to a block."""


def kv_cache_bytes(model_path: str, opts: "VLLMOptions") -> int | None:
    """``kv_cache_memory_bytes`` for ``opts.kv_cache_tokens`` (``None``: not set): per token, K and V
    of every layer (``num_key_value_heads x head_dim`` in the engine's dtype), plus one block per
    sequence. Read from the model's config.json; models whose layers keep less (sliding windows,
    latent attention) get more than they need."""
    tokens = opts.kv_cache_tokens
    if tokens is None:
        return None
    seqs = opts.max_num_seqs or 1
    if tokens == "batch":
        tokens = seqs * opts.max_model_len
    c = json.loads((Path(model_path) / "config.json").read_text())
    c = c.get("text_config", c)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    per_token = c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", heads) * head_dim
    per_token *= 4 if opts.dtype == "float32" else 2
    return per_token * (int(tokens) + KV_BLOCK_TOKENS * seqs)


def engine_env(opts: "VLLMOptions") -> dict[str, str]:
    """Variables this engine sets before vLLM is imported (``ENV_DEFAULTS`` aside): the user's
    ``engine_options.env``, and those of ``multiprocessing`` and ``compile_cache_dir``."""
    env = {k: str(v) for k, v in (opts.engine_options.get("env") or {}).items()}
    if opts.multiprocessing:  # said either way: the engine reads it back (its core in-process or not)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if opts.compile_cache_dir:
        root = os.path.abspath(os.path.expanduser(opts.compile_cache_dir))
        env.update(VLLM_CACHE_ROOT=f"{root}/vllm", TORCHINDUCTOR_CACHE_DIR=f"{root}/inductor",
                   TRITON_CACHE_DIR=f"{root}/triton")
    return env


def llm_kwargs(spec: EngineSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``vllm.LLM`` keyword arguments for ``spec`` and the user's environment: ``(kwargs, env)``.

    The typed options go first; ``policy.generate.engine_options`` adds or overrides keyword
    arguments (``compilation_config``, ``speculative_config`` ...) and may hold ``env``: variables
    set before vLLM is imported. ``env`` is ``engine_env``; ``ENV_DEFAULTS`` apply where neither
    the user nor the process set a value.
    """
    opts = spec.options if isinstance(spec.options, VLLMOptions) else VLLMOptions.model_validate(spec.options)
    extra = dict(opts.engine_options)
    extra.pop("env", None)
    env = engine_env(opts)
    kwargs: dict[str, Any] = {
        "model": os.path.abspath(spec.model_path),
        "skip_tokenizer_init": True,
        "dtype": opts.dtype,
        "seed": spec.seed + 1009 * spec.dist.rank,  # data-parallel generators sample differently
        "enable_sleep_mode": opts.sleep_level > 0,
        "generation_config": "vllm",  # no defaults from generation_config.json: ours are explicit
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": EXTENSION,
    }
    for key in TYPED_OPTIONS:
        if getattr(opts, key) is not None:
            kwargs[key] = getattr(opts, key)
    sizes = opts.cudagraph_capture_sizes
    if sizes is not None and not opts.enforce_eager:
        kwargs["cudagraph_capture_sizes"] = rollout_capture_sizes(opts.max_num_seqs) if sizes == "rollout" else sizes
    kv = kv_cache_bytes(spec.model_path, opts)
    if kv is not None:
        kwargs["kv_cache_memory_bytes"] = kv
    if not opts.torch_compile and not opts.enforce_eager:
        # mode 0: no compilation (config/vllm.py:1166-1172); FULL graphs need none (only piecewise ones
        # do, config/vllm.py:1205-1217)
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    if spec.adapter is not None:  # syncs carry the policy's LoRA adapter: one slot of its rank
        kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=lora_rank(spec.adapter.rank))
    if kwargs.get("tensor_parallel_size", 1) > 1:
        # Inside a Ray actor vLLM would pick its Ray executor and ask Ray for GPUs the actor holds.
        kwargs["distributed_executor_backend"] = "mp"
    kwargs.update(extra)
    cc = kwargs.get("compilation_config")
    chosen = cc.get("cudagraph_capture_sizes") if isinstance(cc, dict) else getattr(cc, "cudagraph_capture_sizes", None)
    if chosen is not None and "cudagraph_capture_sizes" not in extra:
        # the user's compilation_config names the sizes; vLLM takes them there or as the argument, not both
        kwargs.pop("cudagraph_capture_sizes", None)
    return kwargs, env


def rollout_capture_sizes(max_num_seqs: int | None, largest: int = 512) -> list[int]:
    """``cudagraph_capture_sizes: rollout``: 1, 2, 4, 8, 16, then x1.5 steps to 256 and every 64
    above, up to the first size that holds ``max_num_seqs`` sequences (``largest`` at most, vLLM's
    own cap: larger batches run eager; ``None``: to ``largest``).

    Why coarser than vLLM's: a rollout decodes hundreds of sequences at once, where a step is
    bound by the host or by reading the weights, so padding a batch to the next size costs little,
    while every size costs start-up (docs/vllm.md, "Generation speed")."""
    top = min(max_num_seqs or largest, largest)
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256] + list(range(320, largest + 1, 64))
    return [s for s in sizes if s < top] + [next(s for s in sizes if s >= top)]


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (0.25 and 0.33 alike) (``vllm.config.lora.MaxLoRARanks``)."""


def lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    return next(r for r in LORA_RANKS if r >= rank)


