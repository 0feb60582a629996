#!/usr/bin/env bash
# The GPU session of issues 24/25 on ONE GPU, stage by stage; each call of the device tool runs a few
# stages and stays under 10 minutes. From the repository root, the stack of ../shared/gpu/README.md
# shipped to /root/wc (parts 0..7) and, for the TRL stages, ../shared/bench copied to .bench:
#
#   bash benchmarks/gpu_i25.sh setup smoke w gen     # install, model, the co-located PPO test, W, vLLM's ceiling
#   bash benchmarks/gpu_i25.sh eff                   # the train step and logprob phase (train_efficiency --matrix)
#   bash benchmarks/gpu_i25.sh trl32                 # TRL (fp32 + autocast) and xrlhf W as shipped, one call
#   bash benchmarks/gpu_i25.sh trl16 async           # TRL pure bf16 and xrlhf pure bf16; sync-awake vs async
#
# Logs and JSON in $OUT/<stage>/ (OUT: the device tool's folder; ./gpu-out otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=i25
source benchmarks/gpu_env.sh
FINAL=$OUT  # at most 8 files come back from the device tool: everything goes into one archive
OUT=$(mktemp -d /tmp/i25-XXXX)
T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }

run() {  # run NAME LIMIT CMD...: under timeout, logged to $OUT/NAME.log, the tail shown
  local name=$1 limit=$2 t
  shift 2
  t=$(date +%s)
  log "$name: $* (limit ${limit}s)"
  PYTHONUNBUFFERED=1 timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  log "$name: exit $? after $(( $(date +%s) - t ))s"
  grep -v "^\s*$" "$OUT/$name.log" | grep -E -v "it/s\]|Loading weights|^\s+warnings.warn" | tail -${TAIL:-12} | cut -c1-260
}

stage_setup() {
  if [ ! -d /root/site/vllm ]; then
    log "installing the stack"
    (cd /root/wc && cat $(ls p* | sort -V) > s.tar && tar xf s.tar && rm -f s.tar p* && \
      python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site wheels/*.whl && echo installed) \
      2>&1 | tail -2
    # byte-compiled like any installed stack (pip --no-compile above): `import vllm` reads .pyc,
    # not 20-40 s of source, in every start-up measured after this
    local t=$(date +%s)
    python3 -m compileall -q -j 0 /root/site > /dev/null 2>&1
    log "byte-compiled the stack in $(( $(date +%s) - t ))s"
  fi
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  if [ ! -f artifacts/model-0.5b/config.json ]; then
    run model 120 python -m xrlhf.cli make-tiny-model artifacts/model-0.5b --preset 0.5b --dtype bfloat16
  fi
}

stage_smoke() {  # the co-located layout: policy, critic, reference and the generator's own actor on one GPU
  TAIL=8 run smoke 240 python -m pytest -m gpu tests/gpu/test_ppo_vllm.py -k "colocated and not async" -x -q -rA \
    -p no:cacheprovider
}

stage_w() {  # W with our defaults, no TRL: phases, GPU busy, peak
  TAIL=6 run w 300 python -m benchmarks.w_vs_trl --trl-dtype none --variants default --steps 8 --out "$OUT"
}

stage_gen() {  # vLLM's ceiling on W's shape against xrlhf's keyed generate, with and without logprobs
  TAIL=14 run gen 200 python -m benchmarks.generation_bench --engines vllm --prompts 512 --samples-per-prompt 8 \
    --new-tokens 256 --out "$OUT" --name gen \
    --configs '{"w": {"sleep_level": 2, "gpu_memory_utilization": 0.3, "max_model_len": 512, "max_num_seqs": 512}}' \
    --variants raw_no_logprobs,raw_logprobs,engine_keyed,engine_keyed_no_logprobs,worker_keyed
}

stage_eff() {
  TAIL=20 run eff 420 python -m benchmarks.train_efficiency --matrix --compile --out "$OUT"
  TAIL=6 run packing 150 python -m pytest -m gpu tests/gpu/test_packing_gpu.py -x -q -rA -p no:cacheprovider
}

stage_trl32() { TAIL=8 run trl32 590 python -m benchmarks.w_vs_trl --trl-dtype float32 --variants default --out "$OUT"; }
stage_trl16() { TAIL=8 run trl16 470 python -m benchmarks.w_vs_trl --trl-dtype bfloat16 --variants bf16 --out "$OUT"; }
stage_async() { TAIL=8 run async 420 python -m benchmarks.w_vs_trl --trl-dtype none --variants sync-awake,async --out "$OUT"; }

for s in "$@"; do "stage_$s"; done
tar czf "$FINAL/i25-$(IFS=-; echo "$*")-$(date +%H%M%S).tgz" -C "$OUT" --exclude='*.safetensors' . && log "done"
