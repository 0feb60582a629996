#!/usr/bin/env bash
# The GPU session of 2026-11-23 (fourth): issues 15-17 on one GPU. Stages:
#   tests      GPU tests of episodes (vLLM), real architectures (every transport, EOS), packing, LoRA
#   eff        benchmarks/train_efficiency.py (packed + chunked vs the old path on W's shapes)
#   async      benchmarks/async_grpo.py co-located sync and one-step-off on W (after issue 16)
# Logs and JSON go to $OUT/<stage>/. Needs the stack of ../shared/gpu/README.md in /root/site.
set -uo pipefail
STAGE="${1:-tests}"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
case "$STAGE" in
  tests)
    python -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_episodes_vllm.py \
      tests/gpu/test_real_archs_gpu.py tests/gpu/test_packing_gpu.py tests/gpu/test_lora_gpu.py \
      2>&1 | tee "$OUT/tests/pytest.log" | tail -60 ;;
  eff)
    python -m benchmarks.train_efficiency --out "$OUT/eff" 2>&1 | tee "$OUT/eff/log.txt" | tail -40 ;;
  async)
    python -m benchmarks.async_grpo --variants sync-colocated,async-colocated --out "$OUT/async" 2>&1 \
      | tee "$OUT/async/log.txt" | tail -40 ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
