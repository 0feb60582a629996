#!/usr/bin/env bash
# Issue 25, the vLLM engine's generation and start-up on ONE H100, in one call of at most 9 minutes:
#   OUT=/path/to/out bash benchmarks/gpu_i25_gen.sh
# Stages, in this order, each under its own `timeout` and writing its JSON as it goes (logs and JSON in
# $OUT/i25/; the limits add up to 540 s, ~510 s expected). W's engine everywhere: the vLLM options of
# configs/gpu/grpo_w.yaml (sleep level 2, gpu_memory_utilization 0.3, 512 sequences of <= 512 tokens) with
# the KV cache sized for that batch (kv_cache_tokens: batch), so that every start finds the compile cache
# the first one filled (the KV cache's size is part of vLLM's compile cache key; the other options tried
# here are not).
#   model    xrlhf make-tiny-model artifacts/model-0.5b --preset 0.5b --dtype bfloat16, if missing       <= 45 s
#   main     generation_bench on W's shape (512 prompts = 64 x 8, 256 new tokens), its engine started COLD
#            (its start-up is the cold figure): vllm.LLM.generate with and without logprobs (the ceiling),
#            xrlhf's generate with and without, W's sleep-sync-generate cycle, and the same two with the
#            logprobs kept in vLLM's worker (logprobs_path: worker); main-startup.json: vLLM's start-up
#            lines                                                                  generation-main.json  <= 200 s
#   startup  benchmarks.startup --engine, each in a fresh process and then one generation with and without
#            logprobs: "warm-inprocess" (engine core in this process) and "nocompile-inprocess" (also no
#            torch.compile, whole-step CUDA graphs)                                 startup-engine.json  <= 115 s
#   configs  async scheduling off, then prefix caching off: xrlhf's generate with and without logprobs
#            (compare with main's; their start-ups are the warm figure)         generation-configs.json  <= 110 s
#   two      two engines of 256 prompts each on the GPU, two processes (vllm_overhead)  vllm_overhead.json  <= 70 s
# Needs the stack of ../shared/gpu/README.md.
set -uo pipefail
STAGE=i25
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
D="$OUT/i25"
CACHE=/tmp/xrlhf-i25-cache
rm -rf "$CACHE"
export XRLHF_VLLM="{\"compile_cache_dir\": \"$CACHE\"}"  # benchmarks.common.vllm_options gives it to every engine
W='"sleep_level": 2, "gpu_memory_utilization": 0.3, "max_model_len": 512, "max_num_seqs": 512, "kv_cache_tokens": "batch"'
SHAPE="--engines vllm --prompts 512 --samples-per-prompt 8 --new-tokens 256 --out $D"
T0=$(date +%s)
stage() {  # stage NAME LIMIT COMMAND...: under timeout, logged to $D/NAME.log; says how it ended
  local name=$1 limit=$2 t
  shift 2
  t=$(date +%s)
  timeout "$limit" "$@" > "$D/$name.log" 2>&1
  echo "== $name: exit $? in $(( $(date +%s) - t )) s (total $(( $(date +%s) - T0 )) s)"
  grep -v "^\s*$" "$D/$name.log" | grep -v "INFO\|WARNING\|it/s\|^wrote" | tail -6 | cut -c1-240
}

if [ ! -f artifacts/model-0.5b/config.json ]; then
  stage model 45 python -m xrlhf.cli make-tiny-model artifacts/model-0.5b --preset 0.5b --dtype bfloat16
fi
stage main 200 python -m benchmarks.generation_bench $SHAPE --name main --configs "{\"w\": {$W}}" \
  --variants raw_no_logprobs,raw_logprobs,engine_logprobs,engine_no_logprobs,w_cycle,worker_logprobs,worker_w_cycle
python -m benchmarks.startup --parse-log "$D/main.log" > "$D/main-startup.json" 2>/dev/null
stage startup 115 python -m benchmarks.startup --engine --variants warm-inprocess,nocompile-inprocess --generate 512 \
  --generate-for warm-inprocess,nocompile-inprocess --new-tokens 256 --cache-dir "$CACHE" --work "$D/startup-work" \
  --timeout 70 --out "$D"
stage configs 110 python -m benchmarks.generation_bench $SHAPE --name configs \
  --configs "{\"async_off\": {$W, \"async_scheduling\": false}, \"prefix_off\": {$W, \"enable_prefix_caching\": false}}" \
  --variants engine_logprobs,engine_no_logprobs
stage two 70 python -m benchmarks.vllm_overhead --skip-sweep --engines-per-gpu 2 --prompts 512 --new-tokens 256 \
  --engine-options "{$W}" --out "$D"
python -m benchmarks.i25_summary "$D"
echo "total $(( $(date +%s) - T0 )) s"
