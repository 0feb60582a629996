"""benchmarks/train_efficiency.py runs on CPU with a tiny model (``--smoke``) and writes the JSON
the lead reads on the GPU: both paths timed on both workloads, their logprobs equal."""

from __future__ import annotations

import json

import pytest

from benchmarks import train_efficiency


@pytest.mark.slow  # every variant trained and compiled: about a minute
def test_smoke_writes_both_paths(tmp_path):
    data = train_efficiency.main(["--smoke", "--compile", "--variants", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "train_efficiency.json").read_text())
    for key in ("gpu", "train_s", "logprob_s", "train_peak_gib", "baseline_train_s", "baseline_logprob_s",
                "baseline_train_peak_gib"):
        assert key in saved, key
    assert saved["attention_path"] == "varlen" and saved["logprob_chunk_tokens"] == 1024
    for name in ("workload", "long"):
        w = data[name]
        assert w["train_s"] > 0 and w["baseline_train_s"] > 0 and w["train_speedup"] > 0
        assert w["max_abs_logprob_diff"] < 1e-4  # fp32: the same numbers either way
        assert w["loss"] == w["loss"] and w["micro_batches"] >= 1
    assert data["long"]["tokens"] < data["long"]["padded_tokens"]
    assert [v["logprob_s"] > 0 for v in data["workload"]["variants"]] == [True] * 5
    compiled = data["workload"]["compiled"]
    assert compiled["first_call_s"] > 0 and compiled["budget"]["train_s"] > 0
    assert compiled["budget"]["loss"] == compiled["budget"]["loss"]  # finite (each step trains: not comparable)
