#!/usr/bin/env bash
# The GPU stack for the device machine, built on this box (docs/testing.md, "The stack for vLLM
# 0.33"), as parts of one call each (a call carries 64 MiB with the tracked tree):
#   .gpu33/x-K/p   the wheels of benchmarks/gpu_stack.lock (DeepSpeed built as a pure-Python wheel),
#                  installed for CPython 3.12 and packed as `site/` (gzip; PACK=xz: ~25% fewer
#                  parts at ~40 minutes of two cores);
#   .gpu33n/x-K/p  torch's own NVIDIA libraries that the GPU image's are too old for: a tar of
#                  their wheels (xz packs them only ~10% smaller than their zip);
#   .whl           TRL and what it adds, carried by `gpu.sh setup`;
#   .gputrl/x-K/p  TRL's own stack (`trl`: benchmarks/trl_stack.lock, TRL on vLLM 0.25.1, a release it
#                  supports, and the image's torch), packed as `site/` like the first.
# All are ignored by git.
#
#   bash benchmarks/stage_stack.sh                     # ~2.6 GB of downloads, cached in ~/.cache/gpu-wheels33
#   bash benchmarks/stage_stack.sh trl                 # TRL's stack only (~0.5 GB, cached in ~/.cache/gpu-wheels-trl)
#   bash benchmarks/stage_stack.sh site WHEELS PARTS   # one wheel folder as `site/` parts (e.g. the 0.25.1
#                                                      # stack of ../shared/gpu/stage: its cache's selected/wheels)
# Ship one call per part, carrying the part's folder, then `gpu.sh setup` (its stage_install
# unpacks either stream, xz or gzip, and pip-installs a tar of wheels):
#   mkdir -p /root/wc  && mv .gpu33/x-K/p  /root/wc/pK
#   mkdir -p /root/wcn && mv .gpu33n/x-K/p /root/wcn/pK
#   mkdir -p /root/wct && mv .gputrl/x-K/p /root/wct/pK
set -euo pipefail
cd "$(dirname "$0")/.."
# A transfer holds 64 MiB with the tracked tree: each part is what is left, less 2 MiB of slack.
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
part=$(( (62 << 20) - tree ))

split_parts() {  # split_parts DIR: stdin as DIR/x-0/p, DIR/x-1/p, ...
  local dir=$1 n=0 f
  rm -rf "$dir" && mkdir -p "$dir"
  split -b "$part" -d -a 2 - "$dir/p"
  for f in "$dir"/p??; do mkdir -p "$dir/x-$n"; mv "$f" "$dir/x-$n/p"; n=$((n + 1)); done
  echo "staged $(( $(du -cb "$dir"/x-*/p | tail -1 | cut -f1) >> 20 )) MiB as $n parts of at most $((part >> 20)) MiB:" \
    "$dir/x-0 .. $dir/x-$((n - 1))"
}

pack_site() {  # pack_site WHEELS PARTS: the wheels installed for CPython 3.12 x86-64, less what nothing loads
  local wheels=$1 parts=$2 i pack
  [ -d "$wheels" ] || { echo "no wheels in $wheels" >&2; exit 2; }
  work=$(mktemp -d)  # global: the EXIT trap reads it
  trap 'rm -rf "$work"' EXIT
  # Every manylinux tag up to glibc 2.35 (the GPU machine has 2.39): nvidia-nccl-cu13 2.30.7 is manylinux_2_18 only.
  local plat=(--platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64
              --platform manylinux2014_x86_64)
  for i in $(seq 5 35); do plat+=(--platform "manylinux_2_${i}_x86_64"); done
  python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" --target "$work/site" "$wheels"/*.whl
  rm -rf "$work/site/xgrammar/lib/libxgrammar.a" "$work/site/vllm/vllm-rs" "$work/site/ray/jars"
  if [ -d "$work/site/ray/dashboard" ]; then find "$work/site/ray/dashboard" -name '*.map' -delete; fi
  # vLLM (0.25.1 and 0.33.0): FlashAttention 2 (308 MB) is imported only if present (vllm_flash_attn/flash_attn_interface.py,
  # try/except ImportError) and chosen on Hopper only for ALiBi, VLLM_BATCH_INVARIANT or MLA; a plain Llama/Qwen2
  # decoder on SM90 runs FA3 (_vllm_fa3_C, kept). Triton: static archives nothing links at run time, and the
  # Blackwell (sm_100+) ptxas and profiler libraries; the GPU machine is Hopper.
  rm -rf "$work/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$work/site/triton/backends/nvidia/bin/ptxas-blackwell" \
    "$work/site/triton/backends/nvidia/lib/cupti-blackwell" "$work/site/triton/backends/nvidia/lib/cupti/"*_static.a
  if [ "${PACK:-gzip}" = xz ]; then pack=(xz -T0 -6); else pack=(gzip -6); fi
  tar cf - -C "$work" site | "${pack[@]}" | split_parts "$parts"
}

if [ "${1:-}" = site ]; then
  pack_site "${2:?WHEELS}" "${3:?PARTS}"
  exit 0
fi

plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform linux_x86_64)
for i in $(seq 5 35); do plat+=(--platform "manylinux_2_${i}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() { python3 -m pip download -q --no-deps "${plat[@]}" -d "$@"; }

deepspeed_wheel() {  # deepspeed_wheel LOCK CACHE: DeepSpeed as a pure-Python wheel (its CUDA ops compile on first use there)
  local ds
  ds=$(grep '^deepspeed==' "$1" | cut -d= -f3)
  if ! ls "$2/wheels"/deepspeed-"$ds"-*.whl >/dev/null 2>&1; then
    echo "building deepspeed $ds as a pure-Python wheel"
    [ -x "$2/buildenv/bin/pip" ] || python3 -m venv "$2/buildenv"
    "$2/buildenv/bin/pip" install -q setuptools wheel
    DS_BUILD_OPS=0 "$2/buildenv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$2/wheels" "deepspeed==$ds"
  fi
}

if [ "${1:-}" = trl ]; then  # the wheels of the lock alone (the cache may hold others)
  cache=${GPU_TRL_CACHE:-$HOME/.cache/gpu-wheels-trl}
  mkdir -p "$cache/wheels"
  grep -v -e '^#' -e '^deepspeed==' -e '^$' benchmarks/trl_stack.lock > "$cache/req.txt"
  echo "downloading $(wc -l < "$cache/req.txt") wheels into $cache/wheels"
  dl "$cache/wheels" -r "$cache/req.txt"
  deepspeed_wheel benchmarks/trl_stack.lock "$cache"
  rm -rf "$cache/selected" && mkdir -p "$cache/selected"
  while IFS='=' read -r name _ version; do
    f=$(ls "$cache/wheels" | grep -i -E "^${name//[-_.]/[-_.]}-${version}-" | head -1)
    [ -n "$f" ] || { echo "no wheel of $name $version in $cache/wheels" >&2; exit 2; }
    cp "$cache/wheels/$f" "$cache/selected/"
  done < <(grep -v -e '^#' -e '^$' benchmarks/trl_stack.lock)
  pack_site "$cache/selected" .gputrl
  exit 0
fi

cache=${GPU_WHEEL_CACHE:-$HOME/.cache/gpu-wheels33}
mkdir -p "$cache/wheels" "$cache/nvidia" "$cache/trl"

# torch's NVIDIA libraries newer than the image's (NCCL: torch 2.14 needs ncclCommResume; cuDNN:
# a compiled SDPA backward failed in 9.19's frontend), cuBLAS and cuSPARSELt with them.
NVIDIA=${GPU_NVIDIA:-"nvidia-nccl-cu13==2.30.7 nvidia-cudnn-cu13==9.24.0.43 nvidia-cublas==13.1.1.3 nvidia-cusparselt-cu13==0.8.1"}
TRL=${GPU_TRL:-"trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19"}

grep -v -e '^#' -e '^deepspeed==' -e '^$' benchmarks/gpu_stack.lock > "$cache/req.txt"
echo "downloading $(wc -l < "$cache/req.txt") wheels into $cache/wheels"
dl "$cache/wheels" -r "$cache/req.txt"
deepspeed_wheel benchmarks/gpu_stack.lock "$cache"
# shellcheck disable=SC2086  # lists of requirements
dl "$cache/nvidia" $NVIDIA
# shellcheck disable=SC2086
dl "$cache/trl" $TRL
mkdir -p .whl && cp "$cache/trl"/*.whl .whl/

tar cf - -C "$cache" nvidia | split_parts .gpu33n
pack_site "$cache/wheels" .gpu33
