#!/usr/bin/env bash
# The GPU session of issues 24/25 on ONE GPU, stage by stage; each call of the device tool runs a few
# stages and stays under 10 minutes. From the repository root, the stack of ../shared/gpu/README.md
# shipped to /root/wc (parts 0..7) and, for the TRL stages, ../shared/bench copied to .bench:
#
#   bash benchmarks/gpu_i25.sh setup smoke w gen     # install, model, the co-located PPO test, W, vLLM's ceiling
#   bash benchmarks/gpu_i25.sh eff                   # the train step and logprob phase (train_efficiency --matrix), kernel tables
#   bash benchmarks/gpu_i25.sh packing               # tests/gpu/test_packing_gpu.py
#   bash benchmarks/gpu_i25.sh wvar                  # W as shipped / compiled layers / vLLM in-process (start-up too)
#   bash benchmarks/gpu_i25.sh trl32                 # TRL (fp32 + autocast) and xrlhf W as shipped, one call
#   bash benchmarks/gpu_i25.sh trl16 async           # TRL pure bf16 and xrlhf pure bf16; sync-awake vs async
#   bash benchmarks/gpu_i25.sh inflight              # vLLM's in-flight updates, each on_update
#   bash benchmarks/gpu_i25.sh trlc                  # TRL bf16 / fp32, each beside xrlhf with compiled layers
#   bash benchmarks/gpu_i25.sh setup shipped inflight  # W as shipped vs TRL's default (6 steps), then in-flight
#   bash benchmarks/gpu_i25.sh sweep                 # W's train-step peak per token budget, eager and compiled (issue 28)
#   bash benchmarks/gpu_i25.sh setup startup         # start-up: vLLM's import by module, the engine alone
#   bash benchmarks/gpu_i25.sh startupw              # W's handles cold / warm / with vLLM's torch.compile
#                                                    #   (STARTUP_VARIANTS=cold,warm,warm-nocompile,cold-nocompile: 2026-11-26's first)
#   bash benchmarks/gpu_i25.sh async2 distill        # W sync vs one step off (this build); distillation with vLLM
#   bash benchmarks/gpu_i25.sh trl16b packing        # TRL pure bf16 beside xrlhf pure bf16; the packing GPU tests
#   bash benchmarks/gpu_i25.sh startupx gen          # warm start-up's parts; vLLM's ceiling beside our generate
#   bash benchmarks/gpu_i25.sh mps                   # one step off without and with an MPS daemon of our own
#   bash benchmarks/gpu_i25.sh setup mps2            # one step off: ray.mps auto / off
#   bash benchmarks/gpu_i25.sh setup mps3            # sync, one step off with MPS, sync again (one call)
#   bash benchmarks/gpu_i25.sh head shipped          # the logprob chunks compiled vs eager; W as shipped vs TRL
#   bash benchmarks/gpu_i25.sh w2                    # the second workload (1.5b, <= 480 tokens) beside TRL's default
#   SMPROBE="75 100 50" bash benchmarks/gpu_i25.sh smprobe  # GEMMs and W's step under MPS SM limits (mps_sm_probe --bisect)
#   bash benchmarks/gpu_i25.sh streams               # one process, two CUDA streams: generation beside the update
#   bash benchmarks/gpu_i25.sh carveprobe carveout   # GEMMs with SMs carved out (sm_carveout); one step off with it
#   bash benchmarks/gpu_i25.sh setup carveauto     # the shipped sm_carveout default one step off, beside sync
#   bash benchmarks/gpu_i25.sh genrounds             # vLLM alone vs our generate, interleaved rounds (medians)
#   bash benchmarks/gpu_i25.sh setup carveship       # the shipped sm_carveout default one step off, between two sync runs
#   bash benchmarks/gpu_i25.sh setup startlean       # warm start-up: lean Ray head vs Ray's whole head vs Ray preloading vLLM
#   bash benchmarks/gpu_i25.sh setup probe startcold  # vLLM's import in a Ray actor by thread; a cold W start
#   bash benchmarks/gpu_i25.sh install profprobe     # vLLM's import profiled: a plain process vs a Ray actor
#   bash benchmarks/gpu_i25.sh startmain             # then warm starts (STARTUP_VARIANTS), interleaved
#   bash benchmarks/gpu_i25.sh setup carvesweep      # one step off by sm_carveout share (0.35/0.5/0.65), between two sync runs
#   STARTUP_VARIANTS=warm,warm-profile bash benchmarks/gpu_i25.sh setup startcold startmain
#                                                    # with the image's bytecode (2026-11-27, fifth); each build profiled
#   STARTUP_VARIANTS=warm,warm,warm,warm bash benchmarks/gpu_i25.sh setup startcold startmain
#   bash benchmarks/gpu_i25.sh shipped               # W as shipped beside TRL's default (carry .bench); with the
#                                                    #   17 graph sizes: 2026-11-27e, as shipprobe
#   bash benchmarks/gpu_i25.sh shipprobe            # W as shipped beside TRL's default, the host sampled (hostprobe)
#   bash benchmarks/gpu_i25.sh w2probe              # W2 beside TRL's default, the host sampled
#   bash benchmarks/gpu_i25.sh setup prefix         # W with vLLM's prefix caching on (default) and off, interleaved
#   bash benchmarks/gpu_i25.sh startpre             # warm starts with and without Ray's prestarted idle workers
#   bash benchmarks/gpu_i25.sh trainchunk           # W's train phase by the logprob head's chunk (1k / 4k / 8k tokens)
#   bash benchmarks/gpu_i25.sh setup wship          # W as shipped alone, 6 steps (2026-11-27f: the automatic chunk)
#   bash benchmarks/gpu_i25.sh setup twogen startcold startfloor  # one vLLM engine vs two on W's shape; the warm start's floor
#   bash benchmarks/gpu_i25.sh shippedc             # W as shipped beside TRL's default, and the 1,024-token chunk
#   bash benchmarks/gpu_i25.sh setup startcold startpc  # the floor's probes (the worker's class outside Ray); warm starts
#   bash benchmarks/gpu_i25.sh setup startcold startfork  # warm starts: the fork server (shipped) vs none, interleaved
#   bash benchmarks/gpu_i25.sh setup startcold startprev  # warm starts: this build vs the previous one (.prev: carry it,
#                                                    #   made here by `PREV=<commit> bash benchmarks/gpu_i25.sh prevtree`)
#   (the stack as an installed tree in 6-7 parts: benchmarks/stage_site.sh, .gpu/x-K, docs/testing.md; py-spy==0.4.3 among its wheels)
#
# Measured 2026-11-26 (one H200): setup 31 s, eff 141 s, wvar 334 s, smoke 160 s, inflight 54-77 s,
# trlc 490 s, shipped 234 s.
#
# Logs and JSON in $OUT/<stage>/ (OUT: the device tool's folder; ./gpu-out otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=i25
source benchmarks/gpu_lib.sh

stage_smoke() {  # the co-located layout: policy, critic, reference and the generator's own actor on one GPU
  # its run's metrics kept in runs/ (memory timeline: the plan's check of ppo_vllm_colocate, issue 28)
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=8 run smoke 240 python -m pytest -m gpu tests/gpu/test_ppo_vllm.py -k "colocated and not async" -x -q -rA \
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

stage_eff() {  # precisions x budgets, then the fastest compiled; each derived row's kernel table in kernels/
  TAIL=24 run eff "${EFF_LIMIT:-480}" python -m benchmarks.train_efficiency --matrix --compile --profile --out "$OUT"
}

stage_packing() { TAIL=6 run packing 150 python -m pytest -m gpu tests/gpu/test_packing_gpu.py -x -q -rA -p no:cacheprovider; }

stage_wvar() {  # W as shipped, with compiled layers, and with vLLM's engine core in the generator's process
  TAIL=12 run wvar "${WVAR_LIMIT:-540}" python -m benchmarks.w_vs_trl --trl-dtype none --steps 6 --out "$OUT" \
    --variants "default;compiled=policy.train.compile=true|reference.infer.compile=true;inprocess=policy.generate.multiprocessing=false"
}

stage_inflight() {  # vLLM's in-flight weight updates, each on_update mode (engine level, one GPU)
  TAIL=12 run inflight 300 python -m pytest -m gpu tests/gpu/test_vllm_inflight.py -q -rA -s -p no:cacheprovider
}

stage_trl32() { TAIL=8 run trl32 590 python -m benchmarks.w_vs_trl --trl-dtype float32 --variants default --out "$OUT"; }
stage_trl16() { TAIL=8 run trl16 470 python -m benchmarks.w_vs_trl --trl-dtype bfloat16 --variants bf16 --out "$OUT"; }
stage_async() { TAIL=8 run async 420 python -m benchmarks.w_vs_trl --trl-dtype none --variants sync-awake,async --out "$OUT"; }

stage_trlc() {  # TRL pure bf16 then TRL's default, each beside xrlhf with compiled layers (same precision as TRL's)
  local c="policy.train.compile=true|reference.infer.compile=true"
  TAIL=4 run trl16c 290 python -m benchmarks.w_vs_trl --trl-dtype bfloat16 --trl-timeout 170 --steps 6 --out "$OUT/bf16" \
    --variants "bf16-compiled=policy.train.mixed_precision=false|$c"
  TAIL=4 run trl32c 290 python -m benchmarks.w_vs_trl --trl-dtype float32 --trl-timeout 170 --steps 6 --out "$OUT/fp32" \
    --variants "compiled=$c"
}

stage_sweep() {  # the train step's peak per token budget, eager and compiled (the plan's activation model, issue 28)
  TAIL=16 run sweep 300 python -m benchmarks.memory_sweep --out "$OUT"
}

stage_shipped() {  # W as shipped against TRL's default, short (6 steps): a fresh machine's run is a cold start too
  TAIL=6 run shipped 360 python -m benchmarks.w_vs_trl --trl-dtype float32 --trl-timeout 140 --steps 6 --variants default \
    --out "$OUT"
}

stage_startup() {  # where W's start-up goes: vLLM's import module by module (twice: the second is what a
  # warm machine sees), vLLM's engine alone (cold, warm, without torch.compile; generation timed),
  # then W's handles cold / warm / without vLLM's torch.compile (the coordinator's timeline in each)
  mkdir -p "$OUT/startup"
  for i in 1 2; do
    run "importtime_$i" 120 python -X importtime -c "import vllm; from vllm import LLM"
    sort -t'|' -k2 -n -r "$OUT/importtime_$i.log" | head -40 > "$OUT/startup/importtime_top_$i.txt"
  done
  TAIL=6 run startup_engine 300 python -m benchmarks.startup --engine --variants cold,warm,nocompile-inprocess \
    --generate 512 --generate-for warm,nocompile-inprocess --cache-dir /tmp/xrlhf-i25-cache --out "$OUT/startup"
}

stage_startupw() {  # W's handles cold / warm / with vLLM's torch.compile (the coordinator's timeline in each)
  mkdir -p "$OUT/startup"
  TAIL=8 run startup_w 420 python -m benchmarks.startup --variants "${STARTUP_VARIANTS:-cold,warm,warm-compile}" \
    --steps 2 --last-steps 2 --timeout 150 --work /tmp/xrlhf-startup --out "$OUT/startup"
  cp /tmp/xrlhf-startup/*.log "$OUT/startup/" 2>/dev/null
}

stage_async2() {  # one GPU: W as shipped (synchronous) then one step off with vLLM awake, same build, same call
  TAIL=8 run async2 480 python -m benchmarks.w_vs_trl --trl-dtype none --steps 8 --out "$OUT/async2" \
    --variants default,async
}

stage_distill() {  # on-policy distillation with the student sampling through vLLM (issue 27)
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=8 run distill 420 python -m pytest -m gpu tests/gpu/test_distill_vllm.py -x -q -rA \
    -p no:cacheprovider
}

stage_trl16b() {  # TRL pure bf16 beside xrlhf pure bf16 (compiled layers: the default since)
  TAIL=6 run trl16b 420 python -m benchmarks.w_vs_trl --trl-dtype bfloat16 --trl-timeout 200 --steps 8 \
    --out "$OUT/trl16b" --variants bf16
}

stage_mps() {  # one GPU, one step off: without MPS, then every process a client of an MPS daemon of our own
  # (its pipe and log directories ours; no setting of the GPU changed; the daemon quit at the end)
  TAIL=6 run async3 300 python -m benchmarks.w_vs_trl --trl-dtype none --steps 6 --out "$OUT/async3" \
    --variants default,async
  if ! command -v nvidia-cuda-mps-control > /dev/null; then log "mps: no nvidia-cuda-mps-control here"; return; fi
  local pipe log_dir
  pipe=$(mktemp -d /tmp/mps-pipe-XXXX) log_dir=$(mktemp -d /tmp/mps-log-XXXX)
  CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$log_dir nvidia-cuda-mps-control -d
  log "mps: daemon started (exit $?)"
  CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$log_dir TAIL=6 run mps_async 300 \
    python -m benchmarks.w_vs_trl --trl-dtype none --steps 6 --out "$OUT/mps" --variants default,async
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe nvidia-cuda-mps-control
  sleep 2
  mkdir -p "$OUT/mps" && cp -r "$log_dir" "$OUT/mps/daemon_log"
  log "mps: daemon quit; clients seen: $(grep -c -i 'new client' "$log_dir"/control.log 2>/dev/null)"
}

stage_mps2() {  # one step off with MPS as shipped (ray.mps: auto) and without; 2026-11-26's call also capped the
  # trainers' SMs through a ray.mps_thread_percentage option, removed after it (75% gave non-finite losses)
  TAIL=6 run mps2 530 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/mps2" \
    --variants "default,async,async-nomps"
}

stage_mps3() {  # synchronous, one step off (MPS as shipped), synchronous again: the same build, one call
  TAIL=6 run mps3 420 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/mps3" \
    --variants "default;async;sync-again=policy.generate.sleep_level=2"
}

stage_mpstest() {  # the one-step-off co-located GPU test, MPS on by default (ray.mps: auto); vLLM's own lines kept
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=10 run mpstest 300 python -m pytest -m gpu tests/gpu/test_ppo_vllm.py \
    -k "async_colocated" -x -q -rA -s -p no:cacheprovider
  grep -h "MPS" "$OUT/mpstest.log" | head -3
}

stage_distills() {  # the distillation GPU test with vLLM's lines (the tiny model's CUDA-graph memory, issue 28)
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=4 run distills 420 python -m pytest -m gpu tests/gpu/test_distill_vllm.py -x -q -rA \
    -s -p no:cacheprovider
  grep -h -E "Graph capturing finished|Model loading took|KV cache|init engine" "$OUT/distills.log" | cut -c1-200 | head -6
}

stage_startupx() {  # why a warm start takes 27 s: the trainer's compiled layers, Inductor's pool, imports by process
  STARTUP_VARIANTS=cold,warm,warm-eager,warm-threads1,warm-importtime stage_startupw
}

stage_head() {  # W's shipped train step and logprob phase: the logprob chunks compiled (new) and eager; kernel tables
  TAIL=8 run head 300 python -m benchmarks.train_efficiency --matrix --compiled-only --profile --out "$OUT"
}

stage_w2() {  # the second workload (configs/gpu/grpo_w2.yaml: 1.5b, 32 x 8, <= 480 tokens) beside TRL's default
  TAIL=8 run w2 590 python -m benchmarks.w_vs_trl --config configs/gpu/grpo_w2.yaml --model artifacts/model-1.5b \
    --preset 1.5b --trl-args "--prompts-per-step 32 --micro-batch 16 --max-new-tokens 480 --gpu-memory-utilization 0.4" \
    --trl-dtype float32 --trl-timeout 300 --steps 6 --variants default --out "$OUT/w2"
}

stage_smprobe() {  # why a train step under an MPS SM limit of 74-80% gives NaN: the first module whose output
  # is not finite, and W's GEMM shapes alone (mps_sm_probe --bisect), at 75% and, as the control, 100% and 50%
  local pipe log_dir
  pipe=$(mktemp -d /tmp/mps-pipe-XXXX) log_dir=$(mktemp -d /tmp/mps-log-XXXX)
  CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$log_dir nvidia-cuda-mps-control -d
  for v in ${SMPROBE:-75 100 50 "75 --blas cublaslt" "75 --blas cublas"}; do
    set -- $v
    CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$1 TAIL=40 run "smprobe_${v// /_}" 150 \
      python -m benchmarks.mps_sm_probe --bisect "${@:2}"
  done
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe nvidia-cuda-mps-control
}

stage_mpscap() {  # one step off with the trainers' SMs capped under MPS, beside the synchronous step and one step
  # off uncapped, one call. ray.mps_thread_percentage existed for that call (2026-11-26e) and was removed: cuBLAS
  # GEMMs are wrong under most SM limits (smprobe), so this stage no longer runs as written
  local a="rollout.max_staleness=1|policy.generate.sleep_level=0"
  TAIL=8 run mpscap 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/mpscap" \
    --variants "default;async;cap50=$a|ray.mps_thread_percentage.policy=50|ray.mps_thread_percentage.reference=50;cap60=$a|ray.mps_thread_percentage.policy=60|ray.mps_thread_percentage.reference=60"
}

stage_carveprobe() {  # W's GEMM shapes and train step with the GEMMs' SMs carved out (HFModelOptions.sm_carveout:
  # cuBLASLt's SM count target), alone, then under an MPS SM limit of 75% (98 SMs) told to the library (34 carved out)
  TAIL=10 run carveprobe_32 150 python -m benchmarks.mps_sm_probe --bisect --carveout 32
  SMPROBE="75 --carveout 34" stage_smprobe
}

stage_carveout() {  # one step off with the trainers' GEMMs leaving 32 and 66 of 132 SMs to vLLM (sm_carveout, a
  # share since the call of 2026-11-27, which gave SM counts), beside the synchronous step and one step off without it
  local a="rollout.max_staleness=1|policy.generate.sleep_level=0"
  TAIL=8 run carveout 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/carveout" \
    --variants "default;async;carve32=$a|policy.train.sm_carveout=0.24|reference.infer.sm_carveout=0.24;carve66=$a|policy.train.sm_carveout=0.5|reference.infer.sm_carveout=0.5"
}

stage_carveauto() {  # the default then shipped (sm_carveout 0.5, chosen by the coordinator one step off under MPS) beside
  # the synchronous step, one call; the carveout's GPU test first
  TAIL=6 run carvetest 120 python -m pytest -q -m gpu tests/gpu/test_sm_carveout_gpu.py
  TAIL=8 run carveauto 400 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/carveauto" \
    --variants "async=rollout.max_staleness=1|policy.generate.sleep_level=0;sync=policy.generate.sleep_level=2"
  grep -h "leave 50%\|GEMMs target" "$OUT"/carveauto/xrlhf-async/train.log | head -3
  rm -rf /tmp/w_vs_trl-*
}

stage_carvesweep() {  # one step off by the trainers' share of SMs left to vLLM, between two synchronous runs of
  # the same call (the synchronous step moved by 30% between calls: the ratio is to their mean)
  local a="rollout.max_staleness=1|policy.generate.sleep_level=0" v
  v="sync=policy.generate.sleep_level=2"
  for share in 0.35 0.50 0.65; do
    v="$v;c${share#0.}=$a|policy.train.sm_carveout=$share|reference.infer.sm_carveout=$share"
  done
  TAIL=10 run carvesweep 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/carvesweep" \
    --variants "$v;sync2=policy.generate.sleep_level=2"
  rm -rf /tmp/w_vs_trl-*
}

stage_startlean() {  # warm start-up: the lean Ray head (coordinator.lean_head) against Ray's whole head, and
  # Ray's preload of vLLM in every worker; interleaved, twice each, after a cold run fills the caches
  mkdir -p "$OUT/startup"
  TAIL=10 run startup_lean 500 python -m benchmarks.startup --steps 2 --last-steps 2 --timeout 120 \
    --variants "${STARTUP_VARIANTS:-cold,warm,warm-fullhead,warm-preload,warm,warm-fullhead}" \
    --work /tmp/xrlhf-startup --out "$OUT/startup"
  cp /tmp/xrlhf-startup/*.log "$OUT/startup/" 2>/dev/null
}

stage_probe() {  # vLLM's import: a plain process, a Ray actor's call, a thread of it (alone, beside two importing actors)
  TAIL=10 run preload_probe 200 python -m benchmarks.preload_probe --rounds 2 --out "$OUT/startup"
}

stage_profprobe() {  # vLLM's import under cProfile: a plain process against a Ray actor's call
  mkdir -p "$OUT/probe"
  TAIL=6 run preload_profile 150 python -m benchmarks.preload_probe --rounds 1 --modes plain,actor --profile "$OUT/probe" \
    --out "$OUT/probe"
}

stage_startcold() {  # one cold W start: fills the caches the warm variants read
  mkdir -p "$OUT/startup"
  STARTUP_VARIANTS=cold TAIL=4 run startup_cold 200 python -m benchmarks.startup --steps 2 --last-steps 2 --timeout 150 \
    --variants cold --work /tmp/xrlhf-startup --out "$OUT/startup/cold"
}

stage_startmain() {  # warm start-ups, interleaved (2026-11-27: warm,warm-mainpreload,warm; that switch has gone)
  mkdir -p "$OUT/startup"
  TAIL=10 run startup_main 560 python -m benchmarks.startup --steps 2 --last-steps 2 --timeout 120 \
    --variants "${STARTUP_VARIANTS:-warm,warm-fullhead,warm,warm-fullhead}" \
    --work /tmp/xrlhf-startup --out "$OUT/startup"
  cp /tmp/xrlhf-startup/*.log "$OUT/startup/" 2>/dev/null
  cp -r /tmp/xrlhf-startup/profile-* "$OUT/startup/" 2>/dev/null  # warm-profile's cProfile tables
}

stage_carveship() {  # the shipped default (the coordinator's sm_carveout one step off under MPS) between two
  # synchronous runs of one call
  local a="rollout.max_staleness=1|policy.generate.sleep_level=0"
  TAIL=8 run carveship 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/carveship" \
    --variants "sync=policy.generate.sleep_level=2;async=$a;sync2=policy.generate.sleep_level=2"
  grep -h "of the GPU's SMs\|GEMMs target" "$OUT"/carveship/xrlhf-async/train.log | head -3
  rm -rf /tmp/w_vs_trl-*
}

stage_genrounds() {  # vLLM alone against xrlhf's generate paths, interleaved rounds in one engine (medians)
  TAIL=14 run genrounds 300 python -m benchmarks.generation_bench --engines vllm --prompts 512 --samples-per-prompt 8 \
    --new-tokens 256 --out "$OUT" --name genrounds --rounds 5 \
    --configs '{"w": {"sleep_level": 2, "gpu_memory_utilization": 0.3, "max_model_len": 512, "max_num_seqs": 512}}' \
    --variants raw_no_logprobs,raw_logprobs,engine_keyed_no_logprobs,engine_keyed,worker_keyed
}

stage_streams() {  # one process, two streams: vLLM's generation (its thread, a high-priority stream, then an
  # equal one) beside W's update (issue 25 item 4's other way)
  for p in -1 0; do
    TAIL=8 run "streams_p$p" 280 python -m benchmarks.streams_overlap --gen-priority "$p" --out "$OUT/streams"
  done
}

stage_shipprobe() {  # W as shipped beside TRL's default, 8 steps, the host sampled (benchmarks/hostprobe.py):
  # why generation takes 2.2 s in one step and 4 s in the next (steal, the loop thread's CPU, py-spy)
  TAIL=8 run shipprobe 420 python -m benchmarks.hostprobe --out "$OUT/probe" --pyspy 2 -- python -m benchmarks.w_vs_trl \
    --trl-dtype float32 --trl-timeout 140 --steps 8 --variants default --out "$OUT"
  TAIL=40 run probesum 60 python -m benchmarks.hostprobe --summarize "$OUT/probe" "$OUT"/xrlhf-default
  rm -rf /tmp/w_vs_trl-*
}

stage_wprobe() {  # W as shipped alone (no TRL), 10 steps, the host sampled: garbage collections and the canary too
  TAIL=8 run wprobe 300 python -m benchmarks.hostprobe --out "$OUT/wprobe" --pyspy 2 -- python -m benchmarks.w_vs_trl \
    --trl-dtype none --steps 10 --variants default --out "$OUT/w"
  TAIL=40 run wprobesum 60 python -m benchmarks.hostprobe --summarize "$OUT/wprobe" "$OUT"/w/xrlhf-default
  rm -rf /tmp/w_vs_trl-*
}

stage_startprobe() {  # warm starts with the host sampled (hostprobe, no py-spy): which processes burn the CPUs
  # while W's handles start in a fresh `xrlhf run` (15.7-20 s) against a reused driver (13.6-15.3 s, 2026-11-27e)
  mkdir -p "$OUT/startup"
  TAIL=6 run startprobe 400 python -m benchmarks.hostprobe --out "$OUT/startprobe" --interval 0.2 -- \
    python -m benchmarks.startup --steps 2 --last-steps 2 --timeout 120 --variants warm,warm \
    --work /tmp/xrlhf-startup --out "$OUT/startup"
  cp /tmp/xrlhf-startup/*.log "$OUT/startup/" 2>/dev/null
}

stage_prefix() {  # W as shipped against prefix caching off, interleaved (issue 25 item 3: never measured on W).
  # py-spy of 2026-11-27e: block hashing and caching (cache_blocks, create_kv_cache_blocks) ~5% of vLLM's loop thread
  local off="policy.generate.enable_prefix_caching=false"
  TAIL=8 run prefix 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/prefix" \
    --variants "default;noprefix=$off;default2=policy.generate.sleep_level=2;noprefix2=$off"
  rm -rf /tmp/w_vs_trl-*
}

stage_trainchunk() {  # the train phase on an H100 (1.03-1.14 s against the 1.0 s target): the logprob head's chunk
  # of 1,024 tokens (default) against 4,096 and 8,192 (fewer launches of the head's GEMM and log-softmax), interleaved
  local c="policy.train.logprob_chunk_tokens"
  TAIL=8 run trainchunk 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 7 --out "$OUT/trainchunk" \
    --variants "default;chunk4k=$c=4096;chunk8k=$c=8192;default2=policy.generate.sleep_level=2"
  rm -rf /tmp/w_vs_trl-*
}

stage_wship() {  # W as shipped alone, 6 steps (a short lease's check of a new default: the automatic logprob chunk)
  TAIL=6 run wship 250 python -m benchmarks.w_vs_trl --trl-dtype none --variants default --steps 6 --out "$OUT/wship"
  rm -rf /tmp/w_vs_trl-*
}

stage_twogen() {  # issue 25 item 3's "two engine replicas per GPU", on W's shape before any code for it: one
  # engine of 512 x 256 tokens, then two of 256 each in their own processes, with W's vLLM options, 5 rounds each
  # (vllm_overhead --engines-per-gpu 1 2; 2026-11-22's H200 figure, +14%, predates in-process engines and the
  # worker's logprob path). If two pay, the co-located rollout needs 2 generators per policy rank (docs/design/generation-speed.md)
  # (no max_num_seqs: each engine's is its share of the prompts, and its KV cache holds that share)
  local w='"sleep_level": 2, "gpu_memory_utilization": 0.3, "max_model_len": 512, "kv_cache_tokens": "batch"'
  TAIL=8 run twogen 300 python -m benchmarks.vllm_overhead --skip-sweep --engines-per-gpu 1 2 --rounds 5 --prompts 512 \
    --new-tokens 256 --engine-options "{$w}" --out "$OUT/twogen"
}

stage_startpre() {  # warm starts: Ray's idle workers prestarted (one per CPU: 16 import Ray beside the run's
  # actors) against none (RAY_enable_worker_prestart=0), interleaved; a fresh driver each
  STARTUP_VARIANTS="${STARTUP_VARIANTS:-warm,warm-noprestart,warm,warm-noprestart,warm-noprestart}" stage_startmain
}

stage_startfloor() {  # the floor of W's warm start (benchmarks/startfloor.py): Ray to an actor's process, and W's
  # generate engine built in a plain process from its birth (torch, transformers, vLLM, the engine), each alone, 2
  # rounds interleaved, then W's warm start twice in the same call (after startcold: its caches)
  TAIL=14 run startfloor 560 python -m benchmarks.startfloor --rounds 2 --warm 2 --out "$OUT/startfloor"
  cp /tmp/xrlhf-startup/floor-*.log "$OUT/startfloor/" 2>/dev/null
}

stage_startpc() {  # the floor's probes (no W runs), then W's warm starts (2026-11-27, eighth: against
  # warm-precall, vLLM's import begun in a first call as before, a switch that has left the code)
  TAIL=14 run startfloor 300 python -m benchmarks.startfloor --rounds 2 --warm 0 --out "$OUT/startfloor"
  cp /tmp/xrlhf-startup/floor-*.log "$OUT/startfloor/" 2>/dev/null
  STARTUP_VARIANTS="${STARTUP_VARIANTS:-warm,warm,warm}" stage_startmain
}

stage_startfork() {  # warm starts with the fork server (as shipped) and without it (warm-nofork), interleaved
  STARTUP_VARIANTS="${STARTUP_VARIANTS:-warm,warm-nofork,warm,warm-nofork,warm}" stage_startmain
}

stage_prevtree() {  # here, not on the GPU machine: the build PREV (a commit) as files in .prev (git-ignored)
  rm -rf .prev && mkdir -p .prev && git archive "${PREV:?PREV=<commit>}" xrlhf configs | tar -x -C .prev
  echo "$PREV" > .prev/COMMIT
}

stage_startprev() {  # warm starts of this build and the previous one (.prev, its commit in .prev/COMMIT), interleaved
  [ -d .prev/xrlhf ] || { log "startprev: no .prev (carry it: PREV=<commit> bash benchmarks/gpu_i25.sh prevtree)"; return 1; }
  python -m compileall -q .prev/xrlhf > /dev/null
  log "startprev: the previous build is $(cat .prev/COMMIT)"
  XRLHF_PREV_TREE=$PWD/.prev STARTUP_VARIANTS="${STARTUP_VARIANTS:-warm,warm-prev,warm,warm-prev,warm}" stage_startmain
}

stage_shippedc() {  # W as shipped (the automatic logprob chunk: 8,192 tokens on W) beside TRL's default, and the
  # 1,024-token chunk of before as the same call's baseline (6 steps each)
  local c="policy.train.logprob_chunk_tokens=1024|reference.infer.logprob_chunk_tokens=1024"
  TAIL=8 run shippedc 590 python -m benchmarks.w_vs_trl --trl-dtype float32 --trl-timeout 140 --steps 6 \
    --variants "default;chunk1k=$c" --out "$OUT/shippedc"
  rm -rf /tmp/w_vs_trl-*
}

stage_w2probe() {  # W2 beside TRL's default (stage_w2), the host sampled as in shipprobe
  TAIL=8 run w2probe 560 python -m benchmarks.hostprobe --out "$OUT/w2probe" --pyspy 2 -- python -m benchmarks.w_vs_trl \
    --config configs/gpu/grpo_w2.yaml --model artifacts/model-1.5b --preset 1.5b \
    --trl-args "--prompts-per-step 32 --micro-batch 16 --max-new-tokens 480 --gpu-memory-utilization 0.4" \
    --trl-dtype float32 --trl-timeout 300 --steps 6 --variants default --out "$OUT/w2"
  TAIL=30 run w2probesum 60 python -m benchmarks.hostprobe --summarize "$OUT/w2probe" "$OUT"/w2/xrlhf-default
  rm -rf /tmp/w_vs_trl-*
}

for s in "$@"; do "stage_$s"; done
pack "$@"
