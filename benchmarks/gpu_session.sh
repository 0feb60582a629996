#!/usr/bin/env bash
# The GPU session of issue 3 (vLLM engine, weight sync), stage by stage; each stage stays
# under 9 minutes. Run from the repository root on the GPU machine, with the stack installed
# in /root/site (shared/gpu/README.md). Nothing is installed here.
#
#   bash benchmarks/gpu_session.sh hang    # start-up hang bisection          (~3-9 min)
#   bash benchmarks/gpu_session.sh tests   # pytest -m gpu tests/gpu           (~5-8 min)
#   bash benchmarks/gpu_session.sh bench   # generation + weight-sync benchmarks (~5-8 min)
#   bash benchmarks/gpu_session.sh ppo     # 20 PPO steps co-located: times, memory (~4-7 min)
#   bash benchmarks/gpu_session.sh ds-tests  # DeepSpeed on 2 GPUs: ZeRO-3 bf16, offload, PPO (~5-9 min)
#   bash benchmarks/gpu_session.sh ds-bench  # DeepSpeed ZeRO-2 / 3 / 3+offload step time, memory (~4-6 min)
#   bash benchmarks/gpu_session.sh diag    # 2 GPUs: 20 PPO steps co-located, vLLM's engine process vs in-process,
#                                          # side by side, stacks of every process on a stall; then the clean
#                                          # start-up probe of vLLM's defaults          (~8-9 min)
#   bash benchmarks/gpu_session.sh overhead  # 1 GPU: where vLLM's time goes, engines sharing a GPU (~7 min)
#   bash benchmarks/gpu_session.sh gen     # 1 GPU: generation.json, and with grouped-query attention (~6 min)
#   bash benchmarks/gpu_session.sh runner  # 1 GPU: vLLM V2 (default) vs V1 model runner, vLLM only (~4 min)
#   bash benchmarks/gpu_session.sh all     # hang, tests, bench, ppo in turn (longer than one 10-minute call)
#
# Logs and JSON go to $OUT (default ./gpu-out): OUT/<stage>/..., the benchmark JSON to
# OUT/benchmarks/results/ (copy it to benchmarks/results/ and commit). If the hang stage
# prints an `export XRLHF_VLLM=...` line, put it in front of the later stages.
set -uo pipefail
STAGE="${1:-all}"
cd "$(dirname "$0")/.."
export PYTHONPATH=/root/site:$PWD PATH=/root/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled \
       RAY_DEDUP_LOGS=1 XRLHF_VLLM="${XRLHF_VLLM:-}"
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
PY=python

log() { echo "[$(date +%H:%M:%S)] $*"; }

setup() {
  mkdir -p "$OUT/$1"
  { nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; $PY -c \
    "import torch, vllm, ray, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"; \
    echo "XRLHF_VLLM=$XRLHF_VLLM"; } > "$OUT/$1/env.txt" 2>&1
  if [ ! -f artifacts/model-0.5b/config.json ]; then
    log "building artifacts/model-0.5b (492M parameters, BPE 32000)"
    timeout 300 $PY -m xrlhf.cli make-tiny-model artifacts/model-0.5b --preset 0.5b --dtype bfloat16 \
      > "$OUT/$1/make-model.log" 2>&1 || { log "model build failed"; tail -5 "$OUT/$1/make-model.log"; }
  fi
}

stage_hang() {
  setup hang
  log "hang: probes of vLLM start-up (one process each, time-limited, stacks dumped before the limit)"
  timeout 540 $PY -m benchmarks.vllm_hang_probe --out "$OUT/hang" --budget 490 --timeout 170 2>&1 \
    | tee "$OUT/hang/driver.log"
}

stage_tests() {
  setup tests
  log "tests 1/2: vLLM engine against Transformers, each transport (tests/gpu/test_vllm_engine.py)"
  timeout 250 $PY -m pytest -m gpu tests/gpu/test_vllm_engine.py -q -rA -p no:cacheprovider \
    --junitxml="$OUT/tests/junit-engine.xml" 2>&1 | tee "$OUT/tests/pytest-engine.log" | tail -25
  log "tests 2/2: PPO 3 steps per layout (tests/gpu/test_ppo_vllm.py)"
  timeout 290 $PY -m pytest -m gpu tests/gpu/test_ppo_vllm.py -q -rA -p no:cacheprovider \
    --junitxml="$OUT/tests/junit-ppo.xml" 2>&1 | tee "$OUT/tests/pytest-ppo.log" | tail -25
}

stage_bench() {
  setup bench
  mkdir -p "$OUT/benchmarks/results"
  log "bench: generation (vLLM vs HF, 256 x 512 tokens)"
  timeout 300 $PY -m benchmarks.generation_bench --out "$OUT/benchmarks/results" 2>&1 \
    | tee "$OUT/bench/generation.log" | tail -8
  log "bench: weight sync (cpu, cuda_ipc, nccl, d2d copy)"
  timeout 220 $PY -m benchmarks.weight_sync_bench --out "$OUT/benchmarks/results" 2>&1 \
    | tee "$OUT/bench/weight_sync.log" | tail -14
}

stage_ppo() {
  setup ppo
  mkdir -p "$OUT/benchmarks/results"
  log "ppo: 20 steps, co-located config, per-step times and peak memory"
  timeout 530 $PY -m benchmarks.ppo_step_bench --out "$OUT/benchmarks/results" 2>&1 \
    | tee "$OUT/ppo/ppo_step.log" | tail -30
}

# A command under watch: its own TMPDIR (so its Ray and vLLM sockets are its own), stacks of all
# its Python processes on SIGUSR2 (benchmarks/gpu_site), dumped and killed at the limit; Ray's
# logs kept. Usage: watch NAME LIMIT_S CMD...   (logs in $OUT/NAME)
watch() {
  local name=$1 limit=$2; shift 2
  local d="$OUT/$name" tmp="/tmp/x-$name"
  rm -rf "$tmp"; mkdir -p "$d/stacks" "$tmp"
  log "$name: $* (limit ${limit}s)"
  TMPDIR="$tmp" RAY_TMPDIR="$tmp" VLLM_CACHE_ROOT="$tmp/vllm-cache" XRLHF_STACKS_DIR="$d/stacks" \
    PYTHONPATH="$PWD/benchmarks/gpu_site:$PYTHONPATH" PYTHONUNBUFFERED=1 "$@" > "$d/log.txt" 2>&1 &
  local pid=$! t=0
  while kill -0 "$pid" 2>/dev/null && [ "$t" -lt "$limit" ]; do sleep 2; t=$((t + 2)); done
  if kill -0 "$pid" 2>/dev/null; then
    log "$name: still running at ${limit}s: dumping the stacks of its processes"
    ps -eo pid,ppid,pgid,etimes,stat,wchan:28,args --forest > "$d/ps.txt" 2>&1
    nvidia-smi > "$d/nvidia-smi.txt" 2>&1
    for e in /proc/[0-9]*/environ; do  # this run's processes only
      if tr '\0' '\n' 2>/dev/null < "$e" | grep -qx "XRLHF_STACKS_DIR=$d/stacks"; then
        p=${e#/proc/}; kill -USR2 "${p%/environ}" 2>/dev/null
      fi
    done
    sleep 4
    for e in /proc/[0-9]*/environ; do
      if tr '\0' '\n' 2>/dev/null < "$e" | grep -qx "XRLHF_STACKS_DIR=$d/stacks"; then
        p=${e#/proc/}; kill -9 "${p%/environ}" 2>/dev/null
      fi
    done
    echo "KILLED at ${limit}s" >> "$d/log.txt"
  fi
  wait "$pid"; local rc=$?
  log "$name: rc=$rc after ${t}s"
  echo "rc=$rc seconds=$t" > "$d/rc.txt"
  mkdir -p "$d/ray-logs"
  find "$tmp/ray" -path '*/logs/*' -type f -size -4M \( -name '*.out' -o -name '*.err' -o -name '*.log' \) \
    -exec cp {} "$d/ray-logs/" \; 2>/dev/null
  return $rc
}

stage_diag() {
  setup diag
  local inproc='{"engine_options": {"env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}}'
  CUDA_VISIBLE_DEVICES=0 watch diag-mp "${DIAG_LIMIT:-360}" $PY -m benchmarks.ppo_step_bench \
    --out "$OUT/diag-mp" ray.log_to_driver=true &
  local a=$!
  CUDA_VISIBLE_DEVICES=1 XRLHF_VLLM="$inproc" watch diag-inproc "${DIAG_LIMIT:-360}" $PY -m benchmarks.ppo_step_bench \
    --out "$OUT/diag-inproc" ray.log_to_driver=true &
  local b=$!
  wait $a; wait $b
  for v in diag-mp diag-inproc; do log "$v:"; tail -28 "$OUT/$v/log.txt" | cut -c1-240; done
  log "clean start-up probe of vLLM's defaults (engine process forked)"
  CUDA_VISIBLE_DEVICES=0 timeout 170 $PY -m benchmarks.vllm_hang_probe --out "$OUT/hang" --budget 150 \
    --timeout 140 --only default 2>&1 | tail -6
}

stage_layouts() {  # 2 GPUs, ~9 min: issue 3's PPO and transport tests, the 20-step figures
  setup layouts
  mkdir -p "$OUT/benchmarks/results"
  CUDA_VISIBLE_DEVICES=1 watch ppo-bench "${LIMIT_A:-290}" $PY -m benchmarks.ppo_step_bench --verify \
    --out "$OUT/benchmarks/results" &
  local a=$!
  CUDA_VISIBLE_DEVICES=0 watch engine-tests "${LIMIT_A:-290}" $PY -m pytest -m gpu tests/gpu/test_vllm_engine.py \
    -k "not nccl" -q -rA -p no:cacheprovider --junitxml="$OUT/engine-tests/junit.xml" &
  local b=$!
  wait $a; wait $b
  watch split-tests "${LIMIT_B:-230}" $PY -m pytest -m gpu tests/gpu/test_vllm_engine.py tests/gpu/test_ppo_vllm.py \
    -k "nccl or split" -q -rA -p no:cacheprovider --junitxml="$OUT/split-tests/junit.xml"
  for v in ppo-bench engine-tests split-tests; do log "$v:"; grep -v "^\s*$" "$OUT/$v/log.txt" | tail -14 | cut -c1-220; done
}

stage_ds_ppo() {  # 2 GPUs, ~8 min: issue 5's PPO with DeepSpeed + vLLM, and issue 3's co-located PPO test
  setup ds-ppo
  watch ds-ppo "${LIMIT_A:-300}" $PY -m pytest -m gpu tests/gpu/test_deepspeed_gpu.py -k ppo -q -rA \
    -p no:cacheprovider --junitxml="$OUT/ds-ppo/junit.xml"
  watch colocated-test "${LIMIT_B:-170}" $PY -m pytest -m gpu tests/gpu/test_ppo_vllm.py -k colocated -q -rA \
    -p no:cacheprovider --junitxml="$OUT/colocated-test/junit.xml"
  for v in ds-ppo colocated-test; do log "$v:"; grep -v "^\s*$" "$OUT/$v/log.txt" | tail -14 | cut -c1-220; done
}

stage_recheck() {  # 2 GPUs, ~6 min: the vLLM engine tests (transports included); where generation time goes
  setup recheck
  watch transport-tests "${LIMIT_A:-240}" $PY -m pytest -m gpu tests/gpu/test_vllm_engine.py \
    -q -rA -p no:cacheprovider --junitxml="$OUT/transport-tests/junit.xml"
  CUDA_VISIBLE_DEVICES=0 watch gen-breakdown "${LIMIT_B:-130}" $PY -m benchmarks.generation_bench --engines vllm \
    --breakdown --out "$OUT/gen-breakdown"
  for v in transport-tests gen-breakdown; do log "$v:"; grep -v "^\s*$" "$OUT/$v/log.txt" | tail -12 | cut -c1-220; done
  cat "$OUT/gen-breakdown/generation.json" 2>/dev/null | head -24
}

stage_overhead() {  # 1 GPU, ~7 min: vLLM's per-step host work, logprob formats, engines sharing a GPU
  setup overhead
  mkdir -p "$OUT/benchmarks/results"
  CUDA_VISIBLE_DEVICES=0 watch vllm-overhead "${LIMIT_A:-500}" $PY -m benchmarks.vllm_overhead \
    --engines-per-gpu ${ENGINES_PER_GPU:-2 4} --out "$OUT/benchmarks/results"
  grep -v "^\s*$" "$OUT/vllm-overhead/log.txt" | grep -v "INFO\|WARNING" | tail -30 | cut -c1-240
}

stage_gen() {  # 1 GPU, ~6 min: generation.json (vLLM vs HF), and the same for Qwen2.5-0.5B's attention shape
  setup gen
  mkdir -p "$OUT/benchmarks/results"
  for preset in 0.5b 0.5b-gqa; do
    CUDA_VISIBLE_DEVICES=0 watch "gen-$preset" "${LIMIT_A:-270}" $PY -m benchmarks.generation_bench --preset $preset \
      --breakdown --hf-micro-batch 128,256 --out "$OUT/benchmarks/results"
    grep -v "^\s*$" "$OUT/gen-$preset/log.txt" | grep -v "INFO\|WARNING\|it/s" | tail -8 | cut -c1-240
  done
}

stage_runner() {  # 1 GPU, ~4 min: vLLM's V1 model runner against the default V2, vLLM engine only
  setup runner
  for r in 1 0; do  # VLLM_USE_V2_MODEL_RUNNER
    CUDA_VISIBLE_DEVICES=0 XRLHF_VLLM="{\"engine_options\": {\"env\": {\"VLLM_USE_V2_MODEL_RUNNER\": \"$r\"}}}" \
      watch "runner-v2-$r" "${LIMIT_A:-150}" $PY -m benchmarks.generation_bench --engines vllm --breakdown \
      --out "$OUT/runner-v2-$r"
    grep -v "^\s*$" "$OUT/runner-v2-$r/log.txt" | grep -v "INFO\|WARNING\|it/s" | tail -5 | cut -c1-240
  done
}

ds_setup() {  # the DeepSpeed stages need two GPUs and build their own models (no 0.5b, no vLLM)
  mkdir -p "$OUT/$1" "$OUT/benchmarks/results"
  { nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; $PY -c \
    "import torch, deepspeed, ray, transformers; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"; \
    } > "$OUT/$1/env.txt" 2>&1
}

stage_ds_tests() {
  ds_setup ds-tests
  log "ds-tests 1/2: ZeRO-3 bf16 and ZeRO-3 + offload across 2 GPUs (tests/gpu/test_deepspeed_gpu.py)"
  timeout 240 $PY -m pytest -m gpu tests/gpu/test_deepspeed_gpu.py -k "across_two_gpus" -q -rA -p no:cacheprovider \
    --junitxml="$OUT/ds-tests/junit-engine.xml" 2>&1 | tee "$OUT/ds-tests/pytest-engine.log" | tail -25
  log "ds-tests 2/2: PPO 3 steps with a DeepSpeed policy and vLLM, co-located ZeRO-3 and split (NCCL)"
  timeout 290 $PY -m pytest -m gpu tests/gpu/test_deepspeed_gpu.py -k "ppo" -q -rA -p no:cacheprovider \
    --junitxml="$OUT/ds-tests/junit-ppo.xml" 2>&1 | tee "$OUT/ds-tests/pytest-ppo.log" | tail -25
}

stage_ds_bench() {
  ds_setup ds-bench
  log "ds-bench: 1.5B model, ZeRO-2 / ZeRO-3 / ZeRO-3 + offload on 2 GPUs"
  timeout 530 $PY benchmarks/deepspeed_bench.py --out "$OUT/benchmarks/results/deepspeed.json" \
    --model-dir artifacts/model-1.5b 2>&1 | tee "$OUT/ds-bench/deepspeed_bench.log" | tail -8
}

case "$STAGE" in
  hang) stage_hang ;;
  tests) stage_tests ;;
  bench) stage_bench ;;
  ppo) stage_ppo ;;
  ds-tests) stage_ds_tests ;;
  ds-bench) stage_ds_bench ;;
  diag) stage_diag ;;
  layouts) stage_layouts ;;
  ds-ppo) stage_ds_ppo ;;
  recheck) stage_recheck ;;
  overhead) stage_overhead ;;
  gen) stage_gen ;;
  runner) stage_runner ;;
  all) stage_hang; stage_tests; stage_bench; stage_ppo ;;
  *) echo "usage: $0 hang|tests|bench|ppo|diag|layouts|ds-ppo|recheck|overhead|gen|runner|ds-tests|ds-bench|all" >&2; exit 2 ;;
esac
log "done: $STAGE -> $OUT"
