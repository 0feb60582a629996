"""Options of the vLLM generate engine (``policy.generate`` with ``engine: vllm``) and how they
become ``vllm.LLM``'s arguments. Imports no vLLM: ``xrlhf validate`` reads these without it."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field

from xrlhf.engines.base import EngineSpec, GenerateOptions

EXTENSION = "xrlhf.engines.vllm.extension.XrlhfWorkerExtension"

ENV_DEFAULTS = {
    "VLLM_NO_USAGE_STATS": "1",  # the usage thread posts to stats.vllm.ai with no timeout
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # skips the 8.8.8.8 probe of get_ip(); one node only
    # vLLM's engine process: spawned rather than forked from a process whose threads (tokenizers,
    # OpenMP, CUDA) may hold locks the child inherits. vLLM forks by default and that does start
    # (76 s on an H200, docs/vllm.md), but in a worker that already trains, CUDA is initialised
    # and vLLM spawns anyway; spawning always makes the two cases one.
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
        "outputs", description="how the sampled tokens' logprobs reach xrlhf: 'outputs', vLLM's per-token outputs "
        "(per request and step on the host); 'worker', computed by vLLM's own kernel in its worker, kept on the GPU "
        "and fetched once per call (needs vLLM's V2 model runner; docs/design/generation-speed.md)")


TYPED_OPTIONS = ("tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "max_model_len",
                 "max_num_seqs")
"""``VLLMOptions`` fields passed to ``vllm.LLM`` under the same names."""


def llm_kwargs(spec: EngineSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``vllm.LLM`` keyword arguments for ``spec`` and the user's environment: ``(kwargs, env)``.

    ``policy.generate.engine_options`` adds or overrides keyword arguments (``compilation_config``,
    ``max_num_batched_tokens``, ``enable_prefix_caching`` ...) and may hold ``env``: variables
    set before vLLM is imported (``VLLM_ENABLE_V1_MULTIPROCESSING: 0`` runs vLLM's engine in
    this process). ``ENV_DEFAULTS`` apply where neither the user nor the process set a value.
    """
    opts = spec.options if isinstance(spec.options, VLLMOptions) else VLLMOptions.model_validate(spec.options)
    extra = dict(opts.engine_options)
    env = {k: str(v) for k, v in (extra.pop("env", None) or {}).items()}
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
    if spec.adapter is not None:  # syncs carry the policy's LoRA adapter: one slot of its rank
        kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=lora_rank(spec.adapter.rank))
    if kwargs.get("tensor_parallel_size", 1) > 1:
        # Inside a Ray actor vLLM would pick its Ray executor and ask Ray for GPUs the actor holds.
        kwargs["distributed_executor_backend"] = "mp"
    kwargs.update(extra)
    return kwargs, env


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.25.1 accepts (``vllm.config.lora.MaxLoRARanks``)."""


def lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    return next(r for r in LORA_RANKS if r >= rank)


