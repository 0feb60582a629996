"""benchmarks/train_step/efficiency.py runs on CPU with a tiny model (``--smoke``) and writes the JSON
the lead reads on the GPU: both paths timed on both workloads, their logprobs equal; and the
issue-25 matrix (``--matrix``): every precision with both budgets, and the compiled best."""

from __future__ import annotations

import json

import pytest

from benchmarks.train_step import efficiency as train_efficiency


@pytest.mark.long
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


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_smoke_matrix_has_every_variant(tmp_path):
    data = train_efficiency.main(["--smoke", "--matrix", "--compile", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "train_efficiency_matrix.json").read_text())
    rows = saved["rows"]
    assert [(r["precision"], r["budgets"], r["compile"]) for r in rows[:6]] == [
        (p, b, False) for p in ("autocast", "mixed", "bf16") for b in ("derived", "W")]
    assert rows[6]["compile"] and rows[6]["first_call_s"] > 0 and len(rows) == 7
    for r in rows:
        for key in ("variant", "train_s", "infer_s", "infer_s_without_old_logprobs", "peak_gib", "tokens_per_s",
                    "gpu_busy", "micro_batches", "attention"):
            assert key in r, key
        assert r["train_s"] > 0 and r["infer_s"] > 0 and r["infer_s_without_old_logprobs"] > 0  # times: not compared
        assert r["loss"] == r["loss"]  # finite
    # the CPU derives no budget: rows of micro_batch_size; W's budgets cut more micro-batches
    assert rows[1]["micro_batches"] > rows[0]["micro_batches"] and rows[1]["train_budget"] == 48
    # under autocast q reaches the attention in fp32 (a GPU: no flash kernel); with bf16 weights in bf16
    assert any("(fp32" in a for a in rows[0]["attention"]) and not any("(fp32" in a for a in rows[2]["attention"])
    assert data["tokens"] > 0


@pytest.mark.long  # a benchmark's smoke of ~40 s beside a busy core: make test-all (CI) runs it
@pytest.mark.slow  # two engines, one compiled: about 40 s
def test_memory_sweep_smoke_has_each_budget_eager_and_compiled(tmp_path):
    from benchmarks.train_step import sweep as memory_sweep

    memory_sweep.main(["--smoke", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "memory_sweep.json").read_text())["rows"]
    assert [(r["compile"], r["budget"]) for r in rows] == [(c, b) for c in (False, True) for b in (64, 128)]
    for r in rows:  # the budget binds: the largest micro-batch fits it, and a smaller budget cuts more
        assert 0 < r["largest_micro_batch_tokens"] <= r["budget"] and r["train_s"] > 0
    assert rows[0]["micro_batches"] > rows[1]["micro_batches"]
