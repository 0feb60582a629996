#!/usr/bin/env bash
# The GPU session of issue 29 on a machine of TWO GPUs (nvidia-h100-x2 / nvidia-h200-x2), stage by
# stage; each call of the device tool runs a few stages and stays under 10 minutes. From the
# repository root, the stack of ../shared/gpu/README.md shipped to /root/wc (parts 0..7) and
# ../shared/bench copied to .bench (TRL's GRPOTrainer on W):
#
#   bash benchmarks/gpu_i29.sh setup trl_async    # install; TRL (fp32 + autocast) then W split, one step off
#   bash benchmarks/gpu_i29.sh sync               # W split, synchronous (the async run's own baseline)
#   bash benchmarks/gpu_i29.sh lora_ds            # LoRA on ZeRO-3: merged, adapter, resume (alone: ~9 minutes)
#   bash benchmarks/gpu_i29.sh lora_resume        # the resume test of those alone
#   bash benchmarks/gpu_i29.sh split              # the split-layout PPO tests (NCCL, in-flight updates x3)
#   bash benchmarks/gpu_i29.sh heal               # the split generator killed mid-step, twice
#   bash benchmarks/gpu_i29.sh setup inflight     # the in-flight tests alone (each on_update; ~8 minutes)
#   bash benchmarks/gpu_i29.sh ds                 # DeepSpeed's GPU tests on two GPUs
#
# The GPU tests' runs keep their metrics (memory timeline included) in runs/<test>/ of the archive
# (XRLHF_GPU_RUNS): the plan's check against measured memory of configs/gpu/ppo_* (issue 28).
#
# Measured 2026-11-25 (2 x H200): setup 40 s, trl_async 309 s, sync 162 s; lora_ds's first two
# tests ~300 s; heal ran past 350 s (the one-GPU scenario took 485 s).
#
# Logs, JSON and the runs' metrics in one archive in $OUT (the device tool's folder).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=i29
source benchmarks/gpu_lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: never multicast

# TRL runs on GPU 0 alone; the split run then uses both (trainer GPU 0, vLLM GPU 1)
stage_trl_async() {
  TAIL=10 run trl_async 430 python -m benchmarks.w_vs_trl --trl-dtype float32 --trl-timeout 230 \
    --variants async-split --steps 8 --out "$OUT"
}
stage_sync() { TAIL=6 run sync 230 python -m benchmarks.w_vs_trl --trl-dtype none --variants sync-split --steps 8 --out "$OUT"; }
gpu_tests() {  # gpu_tests NAME LIMIT PYTEST-ARGS...
  local name=$1 limit=$2
  shift 2
  XRLHF_LORA_OUT="$OUT/lora_gpu2.json" XRLHF_GPU_RUNS="$OUT/runs" TAIL=${TAIL:-10} run "$name" "$limit" python -m pytest -m gpu "$@" -q -rA \
    -p no:cacheprovider --durations=0
}
stage_lora_ds() { gpu_tests lora_ds 560 tests/gpu/test_lora_gpu.py -k zero3; }
stage_lora_resume() { gpu_tests lora_resume 330 tests/gpu/test_lora_gpu.py -k "zero3 and resume"; }
stage_inflight() { gpu_tests inflight 480 tests/gpu/test_ppo_vllm.py -k in_flight; }  # 256 tokens: syncs land mid-sample
stage_split() { gpu_tests split "${SPLIT_LIMIT:-480}" tests/gpu/test_ppo_vllm.py -k split; }
stage_heal() {  # the generator killed twice, healed in place (no checkpoints): ~4 minutes
  TAIL=30 run heal "${HEAL_LIMIT:-300}" python -m benchmarks.healing --gpu --gpus 2 --timeout "${HEAL_TIMEOUT:-280}" \
    --out "$OUT" --work "$(mktemp -d /tmp/i29-heal-XXXX)"
}
stage_ds() { gpu_tests ds "${DS_LIMIT:-300}" tests/gpu/test_deepspeed_gpu.py ${DS_K:+-k "$DS_K"}; }

for s in "$@"; do "stage_$s"; done
pack "$@"
