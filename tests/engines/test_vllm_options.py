"""The vLLM engine's speed and start-up options on CPU: what reaches ``vllm.LLM`` and its
environment, the KV cache size from ``kv_cache_tokens``, whether the engine starts alone, and the
early import (``preload``). What they do to speed is measured on a GPU (``benchmarks/gpu.sh generation``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.engines.test_vllm_cpu import FakeLLM, engine_spec, vllm_module  # noqa: F401
from xrlhf.engines.base import engine_class, engine_options
from xrlhf.engines.vllm.options import (KV_BLOCK_TOKENS, VLLMOptions, engine_env, kv_cache_bytes, llm_kwargs,
                                       rollout_capture_sizes)


def test_speed_options_reach_vllm_only_when_set(tiny_model):
    kwargs, _ = llm_kwargs(engine_spec(tiny_model))
    for key in ("async_scheduling", "enable_prefix_caching", "max_num_batched_tokens", "kv_cache_memory_bytes"):
        assert key not in kwargs  # vLLM's defaults
    assert kwargs["cudagraph_capture_sizes"] == rollout_capture_sizes(None)  # ours (below)
    kwargs, _ = llm_kwargs(engine_spec(tiny_model, cudagraph_capture_sizes=None))
    assert "cudagraph_capture_sizes" not in kwargs  # null: vLLM's own sizes
    kwargs, _ = llm_kwargs(engine_spec(tiny_model, enforce_eager=True))
    assert "cudagraph_capture_sizes" not in kwargs  # eager: no graphs to size
    # sizes in the user's compilation_config win (vLLM refuses them in both places)
    kwargs, _ = llm_kwargs(engine_spec(tiny_model, engine_options={"compilation_config": {
        "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 4]}}))
    assert "cudagraph_capture_sizes" not in kwargs
    assert kwargs["compilation_config"]["cudagraph_capture_sizes"] == [1, 4]
    piecewise = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    kwargs, _ = llm_kwargs(engine_spec(tiny_model, engine_options=piecewise))
    assert kwargs["cudagraph_capture_sizes"] == rollout_capture_sizes(None)  # other compilation settings keep ours
    kwargs, env = llm_kwargs(engine_spec(tiny_model, async_scheduling=False, enable_prefix_caching=False,
                                         max_num_batched_tokens=32768, cudagraph_capture_sizes=[1, 8, 64, 512]))
    assert (kwargs["async_scheduling"], kwargs["enable_prefix_caching"], kwargs["max_num_batched_tokens"],
            kwargs["cudagraph_capture_sizes"]) == (False, False, 32768, [1, 8, 64, 512])
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # engine_spec's: vLLM's engine core in a process of its own
    # ours: the engine core in the generator's process
    assert engine_env(VLLMOptions(engine="vllm")) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # ours: no torch.compile, the decode steps whole CUDA graphs
    assert kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    kwargs, _ = llm_kwargs(engine_spec(tiny_model, torch_compile=True))
    assert "compilation_config" not in kwargs  # vLLM's default: compiled
    kwargs, _ = llm_kwargs(engine_spec(tiny_model, torch_compile=False, enforce_eager=True))
    assert "compilation_config" not in kwargs and kwargs["enforce_eager"]  # eager: no graphs either
    kwargs, _ = llm_kwargs(engine_spec(tiny_model, enable_prefix_caching=False,
                                       engine_options={"enable_prefix_caching": True}))
    assert kwargs["enable_prefix_caching"] is True  # engine_options has the last word, as documented


def test_rollout_graph_sizes_grow_by_half_then_by_64_up_to_the_batch():
    assert rollout_capture_sizes(512) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512]
    assert rollout_capture_sizes(None) == rollout_capture_sizes(512) == rollout_capture_sizes(4096)  # vLLM's cap
    assert rollout_capture_sizes(300) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320]
    assert rollout_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert rollout_capture_sizes(3) == [1, 2, 4]  # the last size holds the whole batch
    assert rollout_capture_sizes(1) == [1]
    sizes = rollout_capture_sizes(512)
    steps = [b / a for a, b in zip(sizes, sizes[1:])]
    assert max(steps[4:12]) == 1.5 and max(steps[12:]) == 320 / 256  # padding: at most 50%, then 25%


def test_start_up_options_set_the_environment(tiny_model, tmp_path):
    opts = VLLMOptions(engine="vllm", multiprocessing=False, compile_cache_dir=str(tmp_path / "cc"),
                       engine_options={"env": {"VLLM_LOGGING_LEVEL": "DEBUG"}})
    assert engine_env(opts) == {"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                "VLLM_CACHE_ROOT": f"{tmp_path}/cc/vllm", "TORCHINDUCTOR_CACHE_DIR": f"{tmp_path}/cc/inductor",
                                "TRITON_CACHE_DIR": f"{tmp_path}/cc/triton"}
    assert engine_env(VLLMOptions(engine="vllm")) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine_env(VLLMOptions(engine="vllm", multiprocessing=True)) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def test_kv_cache_tokens_become_bytes_from_the_models_shape(tiny_model):
    c = json.loads((Path(tiny_model) / "config.json").read_text())
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    opts = VLLMOptions(engine="vllm", dtype="bfloat16", kv_cache_tokens=1000, max_num_seqs=4)
    assert kv_cache_bytes(tiny_model, opts) == per_token * 2 * (1000 + 4 * KV_BLOCK_TOKENS)
    batch = VLLMOptions(engine="vllm", dtype="float32", kv_cache_tokens="batch", max_num_seqs=8, max_model_len=300)
    assert kv_cache_bytes(tiny_model, batch) == per_token * 4 * (8 * 300 + 8 * KV_BLOCK_TOKENS)
    kwargs, _ = llm_kwargs(engine_spec(tiny_model, kv_cache_tokens="batch", max_num_seqs=8, max_model_len=300))
    assert kwargs["kv_cache_memory_bytes"] == kv_cache_bytes(tiny_model, batch)
    assert kv_cache_bytes(tiny_model, VLLMOptions(engine="vllm")) is None


@pytest.mark.parametrize("fields,message", [
    ({"kv_cache_tokens": "batch", "max_num_seqs": 8}, "policy.generate.kv_cache_tokens: 'batch' is max_num_seqs x"),
    ({"kv_cache_tokens": 0}, "policy.generate.kv_cache_tokens: give a positive number"),
    ({"logprobs_path": "gpu"}, "logprobs_path"),
    ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes"),
])
def test_bad_options_name_their_yaml_path(fields, message):
    with pytest.raises(ValidationError, match=message):
        engine_options("vllm", "generate", {"engine": "vllm", **fields}, path="policy.generate")


def test_the_engine_starts_alone_unless_the_kv_cache_is_sized():
    cls = engine_class("vllm", "generate")
    assert cls.starts_alone_with({"engine": "vllm"})
    assert not cls.starts_alone_with(VLLMOptions(engine="vllm", kv_cache_tokens=4096))
    assert not cls.starts_alone_with({"engine": "vllm", "kv_cache_tokens": "batch", "max_num_seqs": 2,
                                      "max_model_len": 64})
    assert not engine_class("hf", "generate").starts_alone_with({})


def test_preload_sets_the_environment_and_imports_vllm(vllm_module, monkeypatch, tmp_path):
    import sys

    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
              "VLLM_NO_USAGE_STATS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VLLM_HOST_IP", "10.0.0.1")  # set by the process: kept
    vllm_module.VLLMGenerateEngine.preload({"engine": "vllm", "multiprocessing": False,
                                            "compile_cache_dir": str(tmp_path)})
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["VLLM_CACHE_ROOT"] == f"{tmp_path}/vllm"
    assert os.environ["VLLM_NO_USAGE_STATS"] == "1" and os.environ["VLLM_HOST_IP"] == "10.0.0.1"
    assert sys.modules["vllm"].LLM is FakeLLM
    # vLLM's model inspection now runs in this process (a fresh machine's cache miss: no new Python)
    assert sys.modules["vllm.model_executor.models.registry"]._run_in_subprocess(lambda: 7) == 7


def test_vllms_chat_template_warmup_warning_is_dropped_and_other_warnings_are_kept(caplog):
    """vLLM 0.33's ``LLM.__init__`` warms a chat template up, which fails without a tokenizer
    (``skip_tokenizer_init``) and logs a traceback: the engine drops that one record."""
    import logging

    from xrlhf.engines.vllm.engine import quiet_chat_template_warmup

    quiet_chat_template_warmup()
    quiet_chat_template_warmup()  # once per process, however many engines
    log = logging.getLogger("vllm.renderers.base")
    assert sum(type(f).__name__ == "_NoChatTemplateWarmup" for f in log.filters) == 1
    with caplog.at_level(logging.WARNING, logger="vllm.renderers.base"):
        try:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        except ValueError:
            log.warning("Chat template warmup failed", exc_info=True)
        log.warning("Multi-modal warmup failed")
    assert [r.getMessage() for r in caplog.records] == ["Multi-modal warmup failed"]
