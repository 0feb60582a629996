"""docs/benchmarks.md's table of ``benchmarks/generation.py --configs`` runs, from hand-made results."""

from __future__ import annotations

from benchmarks.report import generation_configs


def result(variants: dict) -> dict:
    return {"gpu": "GPU X", "model_params": 1_000, "model_preset": "1.5b", "prompts": 256, "samples_per_prompt": 8,
            "new_tokens": 480, "versions": {"vllm": "0.33.0"}, "date": "d", "command": "c",
            "configs": {"w2": {"startup_s": 40.0, "variants": variants}}}


def test_each_variant_is_compared_with_its_configurations_floor():
    lines = generation_configs("generation-w2.json", result({
        "raw_no_logprobs": {"seconds": 2.0, "min_s": 1.9, "max_s": 2.4, "tokens_per_s": 61440, "ms_per_step": 4.17,
                            "gpu_utilization": 90.0},
        "worker_keyed": {"seconds": 2.5, "min_s": 2.5, "max_s": 2.7, "tokens_per_s": 49152, "ms_per_step": 5.21,
                         "gpu_utilization": 80.0}}))
    rows = [line for line in lines if line.startswith("| w2 |")]
    assert len(rows) == 2
    assert rows[0].endswith("| 2.000 | 1.900-2.400 | 61,440 | 4.17 | 90 | 1.00x |")
    assert "logprobs kept in vLLM's worker" in rows[1] and rows[1].endswith("| 1.25x |")  # 2.5 / 2.0
    assert "`generation-w2.json`" in lines[0] and "vllm 0.33.0" in lines[2]


def test_without_a_floor_or_configurations():
    rows = [line for line in generation_configs("g.json", result({"custom": {"seconds": 3.0}})) if "| w2 |" in line]
    assert rows == ["| w2 | 40.0 | custom | 3.000 | — | — | — | — | — |"]
    assert generation_configs("g.json", None) == []
    assert generation_configs("g.json", {"gpu": "GPU X", "configs": {}}) == []  # a run without --configs
