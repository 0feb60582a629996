#!/usr/bin/env bash
# The GPU session of 2026-11-23 (sixth): issues 16 and 17 on one GPU. Stages (each < 10 min):
#   eff       benchmarks/train_efficiency.py with --variants --profile --compile (W, long, mixed precision,
#             compiled layers: added after that session, not run yet)
#   startup   benchmarks/startup.py: W's start-up cold / warm / alone-first / in-process, memory timeline
#   heal      benchmarks/healing.py --gpu: a vLLM generator and the trainer killed mid-step
#   tests     GPU tests that the start order and the reaper touch (vLLM co-located and split), and the
#             packing ones (one device wait per step, compiled layers: added after, not run yet)
# Logs and JSON go to $OUT/<stage>/. Needs the stack of ../shared/gpu/README.md in /root/site.
set -uo pipefail
STAGE="${1:-eff}"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
if [ ! -f artifacts/model-0.5b/config.json ]; then
  timeout 300 python -m xrlhf.cli make-tiny-model artifacts/model-0.5b --preset 0.5b --dtype bfloat16 \
    > "$OUT/$STAGE/make-model.log" 2>&1 || { echo "model build failed"; tail -5 "$OUT/$STAGE/make-model.log"; }
fi
case "$STAGE" in
  eff)
    timeout 560 python -m benchmarks.train_efficiency --variants --profile --compile --out "$OUT/eff" 2>&1 \
      | tee "$OUT/eff/log.txt" | grep -v "^ \|^-" | tail -40 ;;
  startup)
    timeout 570 python -m benchmarks.startup --out "$OUT/startup" --work /tmp/xrlhf-startup 2>&1 \
      | tee "$OUT/startup/log.txt" | tail -30
    cp /tmp/xrlhf-startup/*.log "$OUT/startup/" 2>/dev/null ;;
  heal)
    timeout 560 python -m benchmarks.healing --gpu --out "$OUT/heal" --work /tmp/xrlhf-heal 2>&1 \
      | tee "$OUT/heal/log.txt" | tail -40
    cp /tmp/xrlhf-heal/gpu.log "$OUT/heal/" 2>/dev/null ;;
  tests)
    timeout 560 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_ppo_vllm.py \
      tests/gpu/test_packing_gpu.py 2>&1 \
      | tee "$OUT/tests/pytest.log" | tail -30 ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
