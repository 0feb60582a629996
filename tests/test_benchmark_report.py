"""docs/benchmarks.md's tables of ``benchmarks/generation.py --configs`` and ``benchmarks.w_vs_trl`` runs,
from hand-made results."""

from __future__ import annotations

from benchmarks.common import host_label
from benchmarks.report import generation_configs, w_vs_trl


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


def test_a_w_vs_trl_row_names_its_host_where_recorded():
    entry = {"gpu": "GPU X", "config": "configs/gpu/grpo_w2.yaml", "xrlhf_variant": "default", "trl_dtype": "float32",
             "trl_step_s": 12.0, "xrlhf_step_s": 6.0, "ratio": 0.5, "phases": {"generate": 3.3}}
    with_host, without = (w_vs_trl([e], None)[-2] for e in ({**entry, "host": "CPU Y x16"}, entry))
    assert with_host.startswith("| GPU X (CPU Y x16) |") and "| W2 |" in with_host
    assert without.startswith("| GPU X |")


def test_host_label_names_a_cpu_count():
    label = host_label()
    assert label.rsplit(" x", 1)[1].isdigit() and label.rsplit(" x", 1)[0]
