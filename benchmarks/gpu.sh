#!/usr/bin/env bash
# The one entry point of the GPU benchmarks on the device machine: stages run in turn, each under
# a time limit, logs and tables packed into one archive in $OUT. From the repository root, with the
# stack shipped to /root/wc as parts p0, p1, ... (docs/testing.md: benchmarks/stage_stack.sh) and,
# for TRL, its wheels in .whl (carried; `setup` installs them):
#
#   bash benchmarks/gpu.sh setup versions tests      # install; what is installed; vLLM's one-GPU tests and the hooks' probes
#   bash benchmarks/gpu.sh tests_more                # the other one-GPU tests (speed options, episodes, distillation, archs, packing)
#   bash benchmarks/gpu.sh tests_more+numerics       # two one-GPU stages at once, on GPU 0 and GPU 1
#   bash benchmarks/gpu.sh w                         # W as shipped and on public APIs only, beside TRL's default
#                                                    # (TRL on its own stack when /root/site-trl holds one: TRL_SITE)
#   bash benchmarks/gpu.sh hooks                     # W with each hook of xrlhf.internals off, beside W as shipped
#   bash benchmarks/gpu.sh hooks_cold                # W's first start on an empty vLLM cache, inspection in-process or not
#   bash benchmarks/gpu.sh hooks_async               # W one step off as shipped, then with the pause mid-generation off
#   bash benchmarks/gpu.sh w2                        # the second workload beside TRL's default
#   bash benchmarks/gpu.sh generation_w2             # W2's generation alone: vLLM's floor against xrlhf's path
#   bash benchmarks/gpu.sh attention                 # vLLM's attention backends (FA3, Triton) on W's, W2's and a grouped-KV shape
#   bash benchmarks/gpu.sh w7model w7trl             # 4 GPUs: W7's 7B model built here, TRL's ZeRO-3 recipe on it
#   bash benchmarks/gpu.sh w7plan w7                 # 4 GPUs: the plan, then W7 as planned (layout auto)
#   bash benchmarks/gpu.sh w7co                      # 4 GPUs: W7 co-located (the plan's second choice)
#   W7_GPUS=2 bash benchmarks/gpu.sh w7plan w7       # W7 planned and run on 2 GPUs (what fits there)
#   bash benchmarks/gpu.sh learn                     # configs/gpu/grpo_learn.yaml: one warm-up, RL seeds 0 1 2 (sync)
#   bash benchmarks/gpu.sh learn_sweep               # recipe candidates (LEARN_SWEEP) on seed 0 from the same warm-up
#   bash benchmarks/gpu.sh learn_async               # the same one step off (two GPUs: the split layout too)
#   bash benchmarks/gpu.sh trl_learn                 # TRL's GRPOTrainer from the same warm-up beside xrlhf's seed 0
#   bash benchmarks/gpu.sh numerics                  # W's first steps as shipped against eager, fp32 masters
#
# TRL runs on a vLLM release it supports: with TRL's stack shipped to /root/wct (benchmarks/stage_stack.sh trl:
# TRL on vLLM 0.25.1 and the image's torch), `setup` installs it into /root/site-trl and every stage beside TRL
# gives it that stack (TRL_SITE= puts TRL on xrlhf's stack instead, vLLM 0.33 outside TRL's range).
#
# Each stage's figures: $OUT/<stage>/*.json (w_vs_trl.json's rows); docs/benchmarks.md renders them.
# The learning stages keep their warm-up and runs in runs/learning_gpu (ignored: it stays on a warm
# machine between calls), so a later stage reuses the warm-up and `learn` called again adds the
# seeds a cut call did not start (--reuse-runs).
#
# Other stages: generation, weight_sync (both: vLLM and the transports on W's model), startup (W's
# start, cold then warm, interleaved), train (the train step's matrix), sweep (its peak by token
# budget: the plan's activation model), ppo (PPO's step, co-located), and on two GPUs: deepspeed
# (ZeRO-2/3/offload), heal (the generator killed and healed), tests2 (the two-GPU tests), tp (vLLM
# tensor parallel: tests/gpu/test_vllm_tp.py).
cd "$(dirname "$0")/.."
STAGE=gpu
# The stack of ../shared/gpu/README.md in /root/site, offline.
export PYTHONPATH=/root/site:$PWD PATH=/root/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: never multicast
# The image's own packages (torch, transformers, ... in /opt/torch/.venv) have no usable bytecode
# cache: every process compiled ~2,300 of their modules from source (cProfile of vLLM's import,
# 2026-11-27: builtins.compile 6.4-7.3 s of it, in a plain process and in a Ray actor alike).
# Bytecode goes to a tree of its own instead (stage_install fills it); a user's installed packages
# have theirs, so a start-up measured without this measured this image, not xrlhf.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/root/pycache
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT/$STAGE"
# At most 8 files come back from the device tool: the stages write into a temporary $OUT, packed
# into one archive in $FINAL at the end.
FINAL=$OUT
OUT=$(mktemp -d "/tmp/$STAGE-XXXX")
T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }

run() {  # run NAME LIMIT CMD...: under timeout, logged to $OUT/NAME.log, the tail shown
  local name=$1 limit=$2 t
  shift 2
  t=$(date +%s)
  log "$name: $* (limit ${limit}s)"
  # -k: a command that outlives its TERM (Ray's children) is killed 20 s later, so the stage still packs
  # what it has before the device call's own limit ends everything (2026-11-30: a stage lost all)
  PYTHONUNBUFFERED=1 timeout -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  log "$name: exit $? after $(( $(date +%s) - t ))s"
  grep -v "^\s*$" "$OUT/$name.log" | grep -E -v "it/s\]|Loading weights|^\s+warnings.warn" | tail -${TAIL:-12} | cut -c1-260
}

# pytest on GPU tests: each test's name and outcome as it ends (a stage cut by its limit still says
# which passed), every test's duration, and after FAULT_S seconds in one test the stack of every
# thread (faulthandler): where a test that never ends waits
GPU_PYTEST=(python -m pytest -m gpu -v -rA -p no:cacheprovider --durations=0 -o "faulthandler_timeout=${FAULT_S:-240}")

TRL_SITE=${TRL_SITE-/root/site-trl}
trl_site() {  # the benchmarks' option that gives TRL its own stack, where one is installed
  if [ -n "$TRL_SITE" ] && [ -d "$TRL_SITE/trl" ]; then echo "--trl-site $TRL_SITE"; fi
}

unpack_site() {  # unpack_site PARTS DEST: a stack installed beforehand (benchmarks/stage_stack.sh: `site/` as xz
  # or gzip, smaller than its wheels), shipped as PARTS/p0, p1, ..., becomes DEST; its scripts run this machine's python3
  local tmp
  tmp=$(mktemp -d /root/unpack-XXXX)
  (cd "$1" && cat $(ls p* | sort -V) | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, \
    mode='r|*').extractall('$tmp', filter='fully_trusted')" && rm -f p* && \
    if [ -e "$2" ]; then cp -a "$tmp/site/." "$2"; else mv "$tmp/site" "$2"; fi && rm -rf "$tmp" && \
    { grep -l '^#!.*python' "$2"/bin/* | xargs -r sed -i '1s|^#!.*python.*|#!/usr/bin/env python3|'; } && \
    echo "installed $2") 2>&1 | tail -2
}

install_trl_site() {  # TRL's own stack, shipped to /root/wct as `site/` parts, into $TRL_SITE
  [ -n "$TRL_SITE" ] && [ ! -d "$TRL_SITE/trl" ] && ls /root/wct/p* >/dev/null 2>&1 || return 0
  local t=$(date +%s)
  unpack_site /root/wct "$TRL_SITE"
  python3 -m compileall -q -j 0 "$TRL_SITE" > /dev/null 2>&1
  log "TRL's stack in $TRL_SITE after $(( $(date +%s) - t ))s"
}

stage_install() {  # the stack alone (what needs no model)
  if [ ! -d /root/site/vllm ]; then
    log "installing the stack"
    local magic
    magic=$(cd /root/wc && cat $(ls p* | sort -V) | head -c 6 | od -An -tx1 | tr -d ' ')
    if [ "$magic" = "fd377a585a00" ] || [ "${magic:0:4}" = "1f8b" ]; then
      unpack_site /root/wc /root/site
    else
      (cd /root/wc && cat $(ls p* | sort -V) > s.tar && tar xf s.tar && rm -f s.tar p* && \
        python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site wheels/*.whl && echo installed) \
        2>&1 | tail -2
    fi
    log "installed"
  fi
  if ls /root/wcn/p* >/dev/null 2>&1; then  # a second stream: torch's nvidia libraries, installed over site/
    if [ "$(cd /root/wcn && cat $(ls p* | sort -V) | head -c 6 | od -An -tx1 | tr -d ' ')" = "fd377a585a00" ]; then
      (cd /root/wcn && cat $(ls p* | sort -V) | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, \
        mode='r|xz').extractall('/root', filter='fully_trusted')" && rm -f p* && echo "libraries installed") 2>&1 | tail -2
    else  # a tar of their wheels (benchmarks/stage_stack.sh)
      (cd /root/wcn && cat $(ls p* | sort -V) | tar xf - && rm -f p* && python3 -m pip install -q --no-index --no-deps \
        --no-compile --upgrade --target /root/site nvidia/*.whl && rm -rf nvidia && echo "libraries installed") 2>&1 | tail -2
    fi
  fi
  # Byte-compiled like any installed stack (pip --no-compile above), and the image's packages too
  # (the top of this file says why): `import vllm` reads .pyc, not source, in every start-up measured after
  # this. With the prefix set Python reads bytecode only there: the standard library goes there too.
  if [ ! -f "$PYTHONPYCACHEPREFIX/.image" ]; then
    local t=$(date +%s) image stdlib
    image=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    stdlib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
    mkdir -p "$PYTHONPYCACHEPREFIX"
    python3 -m compileall -q -j 0 "$image" "$stdlib" /root/site > /dev/null 2>&1
    touch "$PYTHONPYCACHEPREFIX/.image"
    log "byte-compiled the image's packages ($image), $stdlib and /root/site into $PYTHONPYCACHEPREFIX in $(( $(date +%s) - t ))s"
  fi
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
}

pack() {  # the archive of everything under $OUT (weights left out), named after the stages run
  tar czf "$FINAL/$STAGE-$(IFS=-; echo "$*")-$(date +%H%M%S).tgz" -C "$OUT" --exclude='*.safetensors' \
    --exclude='*.pt' --exclude='*.bin' . && log "done"
}

stage_setup() {  # the stack (and the wheels carried in .whl: TRL for the stages beside it), TRL's own, W's model
  stage_install
  install_trl_site
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
from benchmarks.common import host_label
print("host", host_label())
PY
  if [ -n "$(trl_site)" ]; then
    # imported, not only read from metadata: a stack that does not import fails here, before a stage beside TRL
    TAIL=6 PYTHONPATH="$TRL_SITE:$PWD" run versions_trl 120 python -c "import torch, transformers, trl, vllm; \
print('TRL stack ($TRL_SITE): torch', torch.__version__, 'vllm', vllm.__version__, 'from', vllm.__file__, \
'trl', trl.__version__, 'transformers', transformers.__version__)"
  fi
  TAIL=30 run hooks_table 120 python -m xrlhf.cli hooks
}

stage_tests() {  # the hooks' probes against the installed libraries, then vLLM's one-GPU tests
  # (the tensor-parallel cases run where there are 2 GPUs, in a call of their own: stage tp. With
  # them, this stage ran past its limit on two H200s, 2026-11-30)
  TAIL=12 run tests_hooks 120 python -m pytest -q -rA -p no:cacheprovider tests/internals/test_hooks.py
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=40 run tests_vllm "${TESTS_LIMIT:-450}" "${GPU_PYTEST[@]}" \
    tests/gpu/test_vllm_engine.py tests/gpu/test_vllm_inflight.py
}

stage_tests_more() {  # the other one-GPU tests: vLLM's speed options, episodes and distillation through vLLM,
  # real architectures through every transport, packing and compiled layers on the GPU
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=40 run tests_more "${TESTS_MORE_LIMIT:-540}" "${GPU_PYTEST[@]}" \
    ${TESTS_MORE_K:+-k "$TESTS_MORE_K"} tests/gpu/test_vllm_speed_options.py tests/gpu/test_episodes_vllm.py \
    tests/gpu/test_distill_vllm.py tests/gpu/test_real_archs_gpu.py tests/gpu/test_packing_gpu.py
}

stage_w() {  # W as shipped and with every hook off, beside TRL's default (6 steps each, one call); SAMPLE_MS=0:
  # no nvidia-smi beside either side (it polls each GPU every 50 ms beside TRL and xrlhf alike)
  TAIL=10 run w 590 python -m benchmarks.w_vs_trl $(trl_site) --trl-dtype float32 --trl-timeout 200 --steps 6 \
    --variants "${W_VARIANTS:-default,public-only}" --sample-ms "${SAMPLE_MS:-50}" --out "$OUT/w"
  rm -rf /tmp/w_vs_trl-*
}

stage_hooks() {  # W with each hook that acts on W switched off, between two runs as shipped (no TRL)
  local v="default"
  for h in ${HOOKS:-process.fork_server ray.worker_niceness vllm.worker_logprobs}; do
    v="$v;off-$h=env:XRLHF_HOOKS_OFF=$h"
  done
  TAIL=14 run hooks 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 4 --variants "$v;default" \
    --out "$OUT/hooks"
  rm -rf /tmp/w_vs_trl-*
}

stage_hooks_cold() {  # W's first start on vLLM's empty cache (modelinfos, compiled graphs), inspection in-process or not
  local c=/tmp/vllm-cache-$$
  TAIL=10 run hooks_cold 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps 3 --variants \
    "cold=env:VLLM_CACHE_ROOT=$c-a;cold-off-vllm.inspect_in_process=env:VLLM_CACHE_ROOT=$c-b|env:XRLHF_HOOKS_OFF=vllm.inspect_in_process" \
    --out "$OUT/hooks_cold"
  rm -rf /tmp/w_vs_trl-* "$c"-*
}

stage_hooks_async() {  # W one step off (where the pause mid-generation acts), then with each hook of HOOKS_ASYNC off
  local h a="rollout.max_staleness=1|policy.generate.sleep_level=0"
  local v="async=$a"
  for h in ${HOOKS_ASYNC:-vllm.pause_mid_generation}; do
    v="$v;off-$h=$a|env:XRLHF_HOOKS_OFF=$h"
  done
  TAIL=12 run hooks_async 590 python -m benchmarks.w_vs_trl --trl-dtype none --steps "${HOOKS_ASYNC_STEPS:-5}" --variants "$v" \
    --out "$OUT/hooks_async"
  rm -rf /tmp/w_vs_trl-*
}

stage_w2() {  # the second workload (configs/gpu/grpo_w2.yaml: 1.5b, 32 x 8, <= 480 tokens) beside TRL's default
  # (TRL_DTYPE=none: xrlhf alone, e.g. on a machine whose TRL stack was not shipped)
  TAIL=8 run w2 590 python -m benchmarks.w_vs_trl $(trl_site) --config configs/gpu/grpo_w2.yaml --model artifacts/model-1.5b \
    --preset 1.5b --trl-args "--prompts-per-step 32 --micro-batch 16 --max-new-tokens 480 --gpu-memory-utilization 0.4" \
    --trl-dtype "${TRL_DTYPE:-float32}" --trl-timeout 300 --steps "${W2_STEPS:-6}" --variants "${W2_VARIANTS:-default}" \
    --sample-ms "${SAMPLE_MS:-50}" --out "$OUT/w2"
  rm -rf /tmp/w_vs_trl-*
}

W7_TRL="--prompts-per-step 64 --micro-batch 8 --max-new-tokens 512 --max-model-len 640 --gpu-memory-utilization 0.3"

stage_w7model() {  # W7's model (Qwen2.5-7B's shape, random weights, 15 GB) built on this machine
  [ -f artifacts/model-7b/config.json ] || \
    run w7model 580 python -m xrlhf.cli make-tiny-model artifacts/model-7b --preset 7b --dtype bfloat16
}

stage_w7trl() {  # TRL 1.16 on W7: accelerate launch, TRL's DeepSpeed ZeRO-3 recipe, vLLM co-located, 4 GPUs
  TAIL=10 run w7trl 590 python -m benchmarks.w_vs_trl $(trl_site) --config configs/gpu/grpo_w7.yaml --model artifacts/model-7b \
    --preset 7b --trl-processes 4 --trl-args "$W7_TRL" --trl-dtype float32 --trl-timeout 570 --steps 5 \
    --variants "" --out "$OUT/w7trl"
}

W7_COLOCATED="layout=null|policy.resources.ranks=4|policy.resources.gpus_per_rank=1|policy.generate.resources=null\
|policy.generate.tensor_parallel_size=1|policy.generate.sleep_level=2|rollout.max_staleness=0|reference.resources.ranks=4\
|reference.resources.colocate_with=policy|policy.train.engine=deepspeed|policy.train.zero_stage=3"

stage_w7() {  # xrlhf on W7 as planned (layout auto: split, one step off); ~4 minutes (checkpoints off)
  TAIL=12 run w7 590 python -m benchmarks.w_vs_trl --config configs/gpu/grpo_w7.yaml --model artifacts/model-7b \
    --preset 7b --trl-dtype none --steps 5 --variants "${W7_VARIANTS:-default=layout=auto|ray.num_gpus=${W7_GPUS:-4}}" \
    --out "$OUT/w7"
  rm -rf /tmp/w_vs_trl-*
}

stage_w7co() {  # xrlhf on W7 co-located (the plan's #2, by hand): 4 x ZeRO-3 ranks, a generator on each GPU
  TAIL=12 run w7co 590 python -m benchmarks.w_vs_trl --config configs/gpu/grpo_w7.yaml --model artifacts/model-7b \
    --preset 7b --trl-dtype none --steps 5 --variants "colocated=$W7_COLOCATED" --out "$OUT/w7co"
  rm -rf /tmp/w_vs_trl-*
}

stage_w7plan() {  # what the plan says for W7 on this machine, written down before the runs (issue 50: within 10% / 25%)
  TAIL=40 run w7plan 120 python -m xrlhf.cli plan configs/gpu/grpo_w7.yaml --gpus "${W7_GPUS:-4}"
}

stage_learn() {  # the learning recipe: its warm-up once (~2.5 min), then seeds 0 1 2 (~2 min each)
  # shellcheck disable=SC2086  # LEARN_RL_SET: RL overrides as words, or `best` (the learn_sweep winner's)
  TAIL=14 run learn 585 python -m benchmarks.learning_gpu --seeds ${LEARN_SEEDS:-0 1 2} --reuse-runs --budget-s 560 \
    ${LEARN_RL_SET:+--rl-set $LEARN_RL_SET} --out "$OUT/learn"
}

stage_learn_sweep() {  # recipe candidates, seed 0, from the same warm-up: LEARN_SWEEP="name:k=v k=v;name2:k=v"
  # The default: the candidates that chose the recipe's RL (docs/benchmarks.md has their figures; the
  # second is configs/gpu/grpo_learn.yaml's now): lr 2e-5 warmed up with sampling at 0.7 and two epochs;
  # the same at lr 5e-6; the lr warm-up alone.
  local spec=${LEARN_SWEEP:-"w20t07e2:policy.generate.temperature=0.7 algorithm.ppo_epochs=2 policy.train.lr_warmup_steps=20 \
trainer.steps=50;lr5e6w10t07e2:policy.generate.temperature=0.7 algorithm.ppo_epochs=2 policy.train.lr=5e-6 \
policy.train.lr_warmup_steps=10 trainer.steps=50;w10:policy.train.lr_warmup_steps=10 trainer.steps=50"}
  local c name left limit=${SWEEP_LIMIT:-250}  # the first candidate holds the warm-up (~55 s)
  IFS=';' read -ra cands <<< "$spec"
  for c in "${cands[@]}"; do
    name=${c%%:*}
    left=$(( ${SWEEP_BUDGET:-570} - ($(date +%s) - T0) ))  # the call's time: a cut run loses the whole archive
    if [ "$left" -lt 150 ]; then log "sweep_$name: not started, ${left}s left of SWEEP_BUDGET"; continue; fi
    # shellcheck disable=SC2086  # the candidate's overrides are words
    TAIL=4 run "sweep_$name" "$(( left < limit ? left : limit ))" python -m benchmarks.learning_gpu --seeds 0 \
      --reuse-runs --rl-set ${c#*:} --out "$OUT/learn_sweep/$name"
  done
}

stage_learn_async() {  # one step off (vLLM awake); with two GPUs on the split layout too
  local v=${LEARN_VARIANTS:-async}
  [ -z "$LEARN_VARIANTS" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && v=async,async-split
  # shellcheck disable=SC2086
  TAIL=14 run learn_async 585 python -m benchmarks.learning_gpu --variants "$v" --seeds ${LEARN_SEEDS:-0} --reuse-runs \
    --budget-s 560 ${LEARN_RL_SET:+--rl-set $LEARN_RL_SET} --out "$OUT/learn_async"
}

stage_trl_learn() {  # TRL 1.16 (.whl, installed by setup) from the warm-up, then xrlhf's seed 0 in the same call
  # TRL_LEARN_ARGS=--reuse-runs: xrlhf's seed 0 kept from an earlier `learn` on this machine (~2.5 min saved)
  # shellcheck disable=SC2086
  TAIL=14 run trl_learn 585 python -m benchmarks.learning_gpu --trl $(trl_site) --seeds 0 --budget-s 575 --trl-timeout 420 \
    $TRL_LEARN_ARGS ${LEARN_RL_SET:+--rl-set $LEARN_RL_SET} --out "$OUT/trl_learn"
}

stage_numerics() {  # the numerics guard: W's first 3 steps, sync and one step off, two runs each (~5 min)
  XRLHF_GPU_RUNS="$OUT/runs" TAIL=30 run numerics "${NUMERICS_LIMIT:-540}" "${GPU_PYTEST[@]}" \
    tests/gpu/test_numerics_guard.py
}

stage_generation() {  # vLLM against the Transformers engine (256 x 512 tokens), then vLLM's host overhead
  TAIL=10 run generation 300 python -m benchmarks.generation --out "$OUT/generation"
  TAIL=10 run vllm_overhead 280 python -m benchmarks.generation overhead --out "$OUT/generation"
}

GEN_W2='"sleep_level": 2, "max_model_len": 512, "max_num_seqs": 256, "kv_cache_tokens": "batch"'

stage_generation_w2() {  # W2's generation alone, 5 rounds interleaved on one engine: vLLM's floor (no logprobs),
  # vLLM's own logprobs, xrlhf's keyed worker path as W2's rollout calls it, and W2's sleep-sync-generate cycle;
  # GEN_W2_CONFIGS: other engine configurations instead (JSON, as --configs; each an engine in a process of its
  # own, in turn), GEN_PASSES times over (A B A B); GEN_VARIANTS: other variants (benchmarks/generation.py's)
  local configs="{\"w2\": {$GEN_W2}}"
  [ -n "${GEN_W2_CONFIGS:-}" ] && configs=$GEN_W2_CONFIGS
  TAIL=12 run generation_w2 400 python -m benchmarks.generation --engines vllm --preset 1.5b --model artifacts/model-1.5b \
    --prompts 256 --samples-per-prompt 8 --new-tokens 480 --gpu-memory-utilization 0.4 --rounds "${GEN_ROUNDS:-5}" \
    --passes "${GEN_PASSES:-1}" --configs "$configs" \
    --variants "${GEN_VARIANTS:-raw_no_logprobs,raw_logprobs,worker_keyed,worker_w_cycle}" --name w2 --out "$OUT/generation"
}

ATTN_TRITON='"engine_options": {"attention_config": {"backend": "TRITON_ATTN"}}'

stage_attention() {  # vLLM's attention backends, its default (FlashAttention 3 on Hopper) against Triton, generation
  # alone on each shape of ATTN_SHAPES (engines in turn, A B A B, two rounds each, xrlhf's keyed path): W's (0.5b,
  # 512 x 256 tokens), W2's (1.5b, 256 x 480), W's on grouped KV heads (0.5b-gqa: 16 query heads over 2)
  local shape preset prompts tokens mem base
  for shape in ${ATTN_SHAPES:-w w2 w-gqa}; do
    case $shape in
      w) preset=0.5b prompts=512 tokens=256 mem=0.3 ;;
      w2) preset=1.5b prompts=256 tokens=480 mem=0.4 ;;
      w-gqa) preset=0.5b-gqa prompts=512 tokens=256 mem=0.3 ;;
      *) log "attention: no shape $shape (w, w2, w-gqa)"; continue ;;
    esac
    base="\"sleep_level\": 2, \"max_model_len\": 512, \"max_num_seqs\": $prompts, \"kv_cache_tokens\": \"batch\""
    TAIL=6 run "attention_$shape" "${ATTN_LIMIT:-190}" python -m benchmarks.generation --engines vllm --preset $preset \
      --model artifacts/model-$preset --prompts $prompts --samples-per-prompt 8 --new-tokens $tokens \
      --gpu-memory-utilization $mem --rounds 2 --passes 2 --configs "{\"fa3\": {$base}, \"triton\": {$base, $ATTN_TRITON}}" \
      --variants worker_keyed --name "attention-$shape" --out "$OUT/generation"
  done
}

stage_weight_sync() {  # each transport (cpu, cuda_ipc, nccl) against a device-to-device copy of the same weights
  TAIL=14 run weight_sync 240 python -m benchmarks.weight_sync --out "$OUT/weight_sync"
}

stage_startup() {  # W's start: one cold run (fills the caches), then warm starts interleaved
  mkdir -p "$OUT/startup"
  TAIL=4 run startup_cold 200 python -m benchmarks.startup --steps 2 --last-steps 2 --timeout 150 --variants cold \
    --work /tmp/xrlhf-startup --out "$OUT/startup/cold"
  TAIL=10 run startup 380 python -m benchmarks.startup --steps 2 --last-steps 2 --timeout 120 \
    --variants "${STARTUP_VARIANTS:-warm,warm-nofork,warm,warm-nofork}" --work /tmp/xrlhf-startup --out "$OUT/startup"
  cp /tmp/xrlhf-startup/*.log "$OUT/startup/" 2>/dev/null
}

stage_train() {  # W's train step by precision and token budget, then the fastest compiled; kernel tables
  TAIL=24 run train "${TRAIN_LIMIT:-480}" python -m benchmarks.train_step --matrix --compile --profile \
    --out "$OUT/train"
}

stage_sweep() {  # the train step's peak per token budget, eager and compiled (the plan's activation model)
  TAIL=16 run sweep 300 python -m benchmarks.train_step sweep --out "$OUT/sweep"
}

stage_ppo() {  # PPO's step co-located on one GPU (configs/gpu/ppo_vllm_colocate.yaml): phases, memory
  TAIL=12 run ppo 420 python -m benchmarks.train_step ppo --out "$OUT/ppo"
}

stage_deepspeed() {  # 2 GPUs: the 1.5b preset's train step under ZeRO-2, ZeRO-3, ZeRO-3 + offload
  [ -f artifacts/model-1.5b/config.json ] || \
    run model15 180 python -m xrlhf.cli make-tiny-model artifacts/model-1.5b --preset 1.5b --dtype bfloat16
  TAIL=8 run deepspeed 530 python -m benchmarks.train_step deepspeed --model-dir artifacts/model-1.5b \
    --out "$OUT/deepspeed/deepspeed.json"
}

stage_heal() {  # 2 GPUs: the split generator killed mid-step, twice, healed in place (~4 minutes)
  TAIL=30 run heal "${HEAL_LIMIT:-300}" python -m benchmarks.recovery heal --gpu --gpus 2 --timeout "${HEAL_TIMEOUT:-280}" \
    --out "$OUT/heal" --work "$(mktemp -d /tmp/heal-XXXX)"
}

stage_tp() {  # 2 GPUs: vLLM tensor parallel (TP 2): every transport to every rank by checksum, LoRA, sleep (3 GPUs: NCCL)
  TAIL=20 run tp "${TP_LIMIT:-400}" "${GPU_PYTEST[@]}" tests/gpu/test_vllm_tp.py
}

stage_tests2() {  # 2 GPUs: the split layout's PPO tests (NCCL, in-flight updates), LoRA on ZeRO-3, DeepSpeed's tests;
  # each run's metrics in runs/ (the plan's check against measured memory, tests/plan/test_measured.py)
  # TESTS2_FILES: some of them (the three take ~20 minutes on two H200s: docs/testing.md)
  # shellcheck disable=SC2086
  XRLHF_LORA_OUT="$OUT/lora_gpu2.json" XRLHF_GPU_RUNS="$OUT/runs" TAIL=20 run tests2 "${TESTS2_LIMIT:-540}" \
    "${GPU_PYTEST[@]}" ${TESTS2_K:+-k "$TESTS2_K"} \
    ${TESTS2_FILES:-tests/gpu/test_ppo_vllm.py tests/gpu/test_lora_gpu.py tests/gpu/test_deepspeed_gpu.py}
}

# A stage argument A+B runs stage A on GPU 0 and stage B on GPU 1 at the same time (two stages
# that need one GPU each, with logs of different names): their cases that need two GPUs skip.
for s in "$@"; do
  [[ $s == *+*+* ]] && { echo "$s: at most two stages at once (two GPUs)"; exit 2; }
  for part in ${s//+/ }; do
    type "stage_$part" >/dev/null 2>&1 || { echo "unknown stage $part"; exit 2; }
  done
done
for s in "$@"; do
  if [[ $s == *+* ]]; then
    log "stages ${s%%+*} on GPU 0 and ${s#*+} on GPU 1, at once"
    (CUDA_VISIBLE_DEVICES=0 "stage_${s%%+*}") &
    (CUDA_VISIBLE_DEVICES=1 "stage_${s#*+}") &
    wait
    continue
  fi
  log "stage $s"
  "stage_$s"
done
pack "${@//+/-}"
