#!/usr/bin/env bash
# The one entry point of the GPU benchmarks on the device machine: stages run in turn, each under
# a time limit, logs and tables packed into one archive in $OUT. From the repository root, with the
# stack shipped to /root/wc as parts p0, p1, ... (docs/testing.md: benchmarks/stage_site.sh) and,
# for TRL, its wheels in .whl (carried; `setup` installs them):
#
#   bash benchmarks/gpu.sh setup versions tests      # install; what is installed; the GPU tests of vLLM and the hooks
#   bash benchmarks/gpu.sh w                         # W as shipped and on public APIs only, beside TRL's default
#   bash benchmarks/gpu.sh hooks                     # W with each hook of xrlhf.internals off, beside W as shipped
#   bash benchmarks/gpu.sh hooks_async               # W one step off as shipped, then with the MPS daemon off
#   bash benchmarks/gpu.sh w2                        # the second workload beside TRL's default
#   bash benchmarks/gpu.sh w7model w7trl             # 4 GPUs: W7's 7B model built here, TRL's ZeRO-3 recipe on it
#   bash benchmarks/gpu.sh w7plan w7                 # 4 GPUs: the plan, then W7 as planned (layout auto)
#   bash benchmarks/gpu.sh w7co                      # 4 GPUs: W7 co-located (the plan's second choice)
#   bash benchmarks/gpu.sh learn                     # configs/gpu/grpo_learn.yaml: one warm-up, RL seeds 0 1 2 (sync)
#   bash benchmarks/gpu.sh learn_async               # the same one step off (two GPUs: the split layout too)
#   bash benchmarks/gpu.sh trl_learn                 # TRL's GRPOTrainer from the same warm-up beside xrlhf's seed 0
#   bash benchmarks/gpu.sh numerics                  # W's first steps as shipped against eager, no MPS, fp32 masters
#
# Each stage's figures: $OUT/<stage>/*.json (w_vs_trl.json's rows); docs/benchmarks.md renders them.
# The learning stages keep their warm-up and runs in runs/learning_gpu (ignored: it stays on a warm
# machine between calls), so a later stage reuses the warm-up and `learn` called again adds the
# seeds a cut call did not start (--reuse-runs).
STAGE=gpu
source benchmarks/gpu_lib.sh

stage_setup() {  # the stack (and the wheels carried in .whl: TRL for the stages beside it), W's model
  stage_install
  if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /root/site/.whl-installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site .whl/*.whl 2>&1 | tail -2
    python3 -m compileall -q -j 0 /root/site > /dev/null 2>&1
    touch /root/site/.whl-installed
  fi
  [ -f artifacts/model-0.5b/config.json ] || \
    run model 180 python -m xrlhf.cli make-tiny-model artifacts/model-0.5b --preset 0.5b --dtype bfloat16
}

stage_versions() {  # the stack as Python sees it, and the hooks as xrlhf sees them
  TAIL=40 run versions 120 python - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
for p in ("vllm", "triton", "ray", "transformers", "deepspeed", "trl"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "absent")
import vllm
print("vllm imported from", vllm.__file__)
PY
  TAIL=30 run hooks_table 120 python -m xrlhf.cli hooks
}

stage_tests() {  # the hooks' probes against the installed libraries, then vLLM's GPU tests
  TAIL=12 run tests_hooks 300 python -m pytest -q -rA -p no:cacheprovider tests/internals/test_hooks.py
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=20 run tests_vllm 420 python -m pytest -m gpu -q -rA -p no:cacheprovider \
    tests/gpu/test_vllm_engine.py tests/gpu/test_vllm_inflight.py tests/gpu/test_vllm_tp.py
}

stage_w() {  # W as shipped and with every hook off, beside TRL's default (6 steps each, one call)
  TAIL=10 run w 590 python -m benchmarks.w_vs_trl --trl-dtype float32 --trl-timeout 200 --steps 6 \
    --variants default,public-only --out "$OUT/w"
  rm -rf /tmp/w_vs_trl-*
}

stage_hooks() {  # W with each hook that acts on W switched off, between two runs as shipped (no TRL)
  local v="default"
  for h in ${HOOKS:-process.fork_server ray.worker_niceness python.entry_points vllm.worker_logprobs \
      vllm.inspect_in_process transformers.attn_implementation transformers.without_sklearn}; do
    v="$v;off-$h=env:XRLHF_HOOKS_OFF=$h"
  done
  TAIL=14 run hooks 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 4 --variants "$v;default" \
    --out "$OUT/hooks"
  rm -rf /tmp/w_vs_trl-*
}

stage_hooks_async() {  # W one step off (where the MPS daemon acts), then with it off
  local a="rollout.max_staleness=1|policy.generate.sleep_level=0"
  TAIL=10 run hooks_async 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 5 --variants \
    "async=$a;off-process.mps_daemon=$a|env:XRLHF_HOOKS_OFF=process.mps_daemon" \
    --out "$OUT/hooks_async"
  rm -rf /tmp/w_vs_trl-*
}

stage_w2() {  # the second workload (configs/gpu/grpo_w2.yaml: 1.5b, 32 x 8, <= 480 tokens) beside TRL's default
  TAIL=8 run w2 590 python -m benchmarks.w_vs_trl --config configs/gpu/grpo_w2.yaml --model artifacts/model-1.5b \
    --preset 1.5b --trl-args "--prompts-per-step 32 --micro-batch 16 --max-new-tokens 480 --gpu-memory-utilization 0.4" \
    --trl-dtype float32 --trl-timeout 300 --steps 6 --variants default --out "$OUT/w2"
  rm -rf /tmp/w_vs_trl-*
}

W7_TRL="--prompts-per-step 64 --micro-batch 8 --max-new-tokens 512 --max-model-len 640 --gpu-memory-utilization 0.3"

stage_w7model() {  # W7's model (Qwen2.5-7B's shape, random weights, 15 GB) built on this machine
  [ -f artifacts/model-7b/config.json ] || \
    run w7model 580 python -m xrlhf.cli make-tiny-model artifacts/model-7b --preset 7b --dtype bfloat16
}

stage_w7trl() {  # TRL 1.16 on W7: accelerate launch, TRL's DeepSpeed ZeRO-3 recipe, vLLM co-located, 4 GPUs
  TAIL=10 run w7trl 590 python -m benchmarks.w_vs_trl --config configs/gpu/grpo_w7.yaml --model artifacts/model-7b \
    --preset 7b --trl-processes 4 --trl-args "$W7_TRL" --trl-dtype float32 --trl-timeout 570 --steps 5 \
    --variants "" --out "$OUT/w7trl"
}

W7_COLOCATED="layout=null|policy.resources.ranks=4|policy.resources.gpus_per_rank=1|policy.generate.resources=null\
|policy.generate.tensor_parallel_size=1|policy.generate.sleep_level=2|rollout.max_staleness=0|reference.resources.ranks=4\
|reference.resources.colocate_with=policy|policy.train.engine=deepspeed|policy.train.zero_stage=3"

stage_w7() {  # xrlhf on W7 as planned (layout auto: split, one step off); ~5 minutes with its last checkpoint
  TAIL=12 run w7 590 python -m benchmarks.w_vs_trl --config configs/gpu/grpo_w7.yaml --model artifacts/model-7b \
    --preset 7b --trl-dtype none --steps 5 --variants "${W7_VARIANTS:-default=layout=auto}" --out "$OUT/w7"
  rm -rf /tmp/w_vs_trl-*
}

stage_w7co() {  # xrlhf on W7 co-located (the plan's #2, by hand): 4 x ZeRO-3 ranks, a generator on each GPU
  TAIL=12 run w7co 590 python -m benchmarks.w_vs_trl --config configs/gpu/grpo_w7.yaml --model artifacts/model-7b \
    --preset 7b --trl-dtype none --steps 5 --variants "colocated=$W7_COLOCATED" --out "$OUT/w7co"
  rm -rf /tmp/w_vs_trl-*
}

stage_w7plan() {  # what the plan says for W7 on this machine, written down before the runs (issue 50: within 10% / 25%)
  TAIL=40 run w7plan 120 python -m xrlhf.cli plan configs/gpu/grpo_w7.yaml --gpus 4
}

stage_learn() {  # the learning recipe: its warm-up once (~2.5 min), then seeds 0 1 2 (~2 min each)
  TAIL=14 run learn 585 python -m benchmarks.learning_gpu --seeds 0 1 2 --reuse-runs --budget-s 560 --out "$OUT/learn"
}

stage_learn_async() {  # one step off (vLLM awake, MPS as shipped); with two GPUs the split layout too
  local v=${LEARN_VARIANTS:-async}
  [ -z "$LEARN_VARIANTS" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && v=async,split
  TAIL=14 run learn_async 585 python -m benchmarks.learning_gpu --variants "$v" --seeds 0 --reuse-runs \
    --budget-s 560 --out "$OUT/learn_async"
}

stage_trl_learn() {  # TRL 1.16 (.whl, installed by setup) from the warm-up, then xrlhf's seed 0 in the same call
  # TRL_LEARN_ARGS=--reuse-runs: xrlhf's seed 0 kept from an earlier `learn` on this machine (~2.5 min saved)
  TAIL=14 run trl_learn 585 python -m benchmarks.learning_gpu --trl --seeds 0 --budget-s 575 --trl-timeout 420 \
    $TRL_LEARN_ARGS --out "$OUT/trl_learn"
}

stage_numerics() {  # the numerics guard: W's first 3 steps, sync and one step off, two runs each (~5 min)
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=30 run numerics 585 python -m pytest -m gpu -q -rA -p no:cacheprovider \
    tests/gpu/test_numerics_guard.py
}

for s in "$@"; do
  type "stage_$s" >/dev/null 2>&1 || { echo "unknown stage $s"; exit 2; }
  log "stage $s"
  "stage_$s"
done
pack "$@"
