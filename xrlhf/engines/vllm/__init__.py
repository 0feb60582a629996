"""The vLLM backend (``engine: vllm``; vLLM 0.33, 0.25): the engine registers itself as ``vllm.generate``
when the registry imports this package. Its modules:

* ``engine``: ``VLLMGenerateEngine``, one ``vllm.LLM`` per engine;
* ``options``: ``VLLMOptions`` and how they become ``vllm.LLM``'s arguments;
* ``extension``: what runs inside vLLM's worker processes (weights in, checksums back);
* ``loop``: the request loop that serves keyed calls and pauses for a weight sync.

None of them imports vLLM at module level (validation and CPU tests run without it). See docs/vllm.md.
"""

from xrlhf.engines.vllm.engine import VLLMGenerateEngine
from xrlhf.engines.vllm.loop import sampled_logprobs
from xrlhf.engines.vllm.options import EXTENSION, LORA_RANKS, VLLMOptions, llm_kwargs, lora_rank

__all__ = ["EXTENSION", "LORA_RANKS", "VLLMGenerateEngine", "VLLMOptions", "llm_kwargs", "lora_rank",
           "sampled_logprobs"]
