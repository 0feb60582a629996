"""``utils.flops``: matrix-multiply weights, train FLOPs and MFU against hand-computed numbers, and
the per-step throughput from the workers' memory stats."""

from __future__ import annotations

import pytest

from xrlhf.utils.flops import MatmulShape, StepThroughput, mfu, peak_flops, train_flops

SMALL = {"hidden_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 2, "num_key_value_heads": 1,
         "intermediate_size": 8, "vocab_size": 10}


def test_matmul_weights_of_a_small_config_by_hand():
    shape = MatmulShape.of_config(SMALL)
    # per layer: q, o 4 x 4 each (32), k, v 4 x 2 each (16), MLP 3 x 4 x 8 (96) = 144; two layers; head 10 x 4
    assert shape == MatmulShape(matmul_params=2 * 144 + 40, layers=2, width=4)
    assert MatmulShape.of_config({"text_config": SMALL}) == shape


def test_qwen_7b_counts_its_matmul_weights():
    shape = MatmulShape.of_model("configs/shapes/qwen2.5-7b")
    # 7.62B parameters, less the untied input embedding (152,064 x 3,584) and the biases
    assert shape.matmul_params == pytest.approx(7.07e9, rel=0.01)
    assert (shape.layers, shape.width) == (28, 3584)


def test_train_flops_and_mfu_by_hand():
    shape = MatmulShape(matmul_params=328, layers=2, width=4)
    # sequences of 4 and 6 tokens: 10 tokens, 16 + 36 = 52 squared
    assert train_flops(shape, 10, 52) == 6 * 328 * 10 + 6 * 2 * 4 * 52 == 22176
    assert mfu(22176, 2.0, 1000.0, 4) == pytest.approx(22176 / 8000)
    assert mfu(1.0, 0.0, 1000.0, 1) == 0.0


def test_peaks_by_device_name():
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Other GPU") is None


def test_step_throughput_counts_distinct_gpus_and_the_policys():
    t = StepThroughput(MatmulShape(matmul_params=328, layers=2, width=4), epochs=2)
    assert t.metrics({"perf/sequence_tokens": 10, "time/step_s": 1.0}) == {}  # no GPU seen: a CPU run
    h200 = {"gpu_name": "NVIDIA H200"}
    t.see({"policy": [{"gpu": "a", **h200}, {"gpu": "b", **h200}], "rollout": [{"gpu": "a", **h200}],
           "reference": [{"gpu": "c", **h200}], "reward": [{"rss_gb": 1.0}]})
    m = t.metrics({"perf/sequence_tokens": 600.0, "perf/sequence_tokens_sq": 52.0, "time/step_s": 2.0,
                   "time/train_s": 0.5})
    assert m["perf/tokens_per_s_per_gpu"] == pytest.approx(600 / 2 / 3)  # GPUs a, b, c
    flops = 6 * 328 * 1200 + 6 * 2 * 4 * 104  # two epochs
    assert m["perf/train_mfu"] == pytest.approx(flops / (0.5 * 989.4e12 * 2))  # the policy's two GPUs


def test_no_mfu_for_an_unknown_or_mixed_gpu():
    t = StepThroughput(MatmulShape(matmul_params=328, layers=2, width=4))
    t.see({"policy": [{"gpu": "a", "gpu_name": "NVIDIA H200"}, {"gpu": "b", "gpu_name": "NVIDIA A100"}]})
    m = t.metrics({"perf/sequence_tokens": 100.0, "time/step_s": 1.0, "time/train_s": 0.5})
    assert set(m) == {"perf/tokens_per_s_per_gpu"}
