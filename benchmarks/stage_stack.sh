#!/usr/bin/env bash
# Everything the device machine needs for the vLLM 0.33 stack, built from nothing on this box
# (docs/testing.md, "The stack for vLLM 0.33"): the wheels of benchmarks/gpu_stack.lock
# downloaded (DeepSpeed built as a pure-Python wheel), installed for CPython 3.12 and packed by
# stage_site.sh into .gpu33/x-K/p; torch's own NVIDIA libraries that the GPU image's are too old
# for, as a second stream (a tar of their wheels) in .gpu33n/x-K/p; TRL and what it adds in .whl. All three are ignored by git.
#
#   bash benchmarks/stage_stack.sh            # ~2 GB of downloads (cached in ~/.cache/gpu-wheels33)
#
# Ship: one call per part, carrying the part's folder,
#   mkdir -p /root/wc  && mv .gpu33/x-K/p  /root/wc/pK
#   mkdir -p /root/wcn && mv .gpu33n/x-K/p /root/wcn/pK
# then `bash benchmarks/gpu.sh setup ...` carrying .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${GPU_WHEEL_CACHE:-$HOME/.cache/gpu-wheels33}
mkdir -p "$cache/wheels" "$cache/nvidia" "$cache/trl"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform linux_x86_64)
for i in $(seq 5 35); do plat+=(--platform "manylinux_2_${i}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() { python3 -m pip download -q --no-deps "${plat[@]}" -d "$@"; }

# torch's NVIDIA libraries newer than the image's (NCCL: torch 2.14 needs ncclCommResume; cuDNN:
# a compiled SDPA backward failed in 9.19's frontend), cuBLAS and cuSPARSELt with them.
NVIDIA=${GPU_NVIDIA:-"nvidia-nccl-cu13==2.30.7 nvidia-cudnn-cu13==9.24.0.43 nvidia-cublas==13.1.1.3 nvidia-cusparselt-cu13==0.8.1"}
TRL=${GPU_TRL:-"trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19"}

grep -v -e '^#' -e '^deepspeed==' -e '^$' benchmarks/gpu_stack.lock > "$cache/req.txt"
echo "downloading $(wc -l < "$cache/req.txt") wheels into $cache/wheels"
dl "$cache/wheels" -r "$cache/req.txt"
ds=$(grep '^deepspeed==' benchmarks/gpu_stack.lock | cut -d= -f3)
if ! ls "$cache/wheels"/deepspeed-"$ds"-*.whl >/dev/null 2>&1; then
  echo "building deepspeed $ds as a pure-Python wheel (its CUDA ops compile on first use there)"
  [ -x "$cache/buildenv/bin/pip" ] || python3 -m venv "$cache/buildenv"
  "$cache/buildenv/bin/pip" install -q setuptools wheel
  DS_BUILD_OPS=0 "$cache/buildenv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$cache/wheels" "deepspeed==$ds"
fi
# shellcheck disable=SC2086  # lists of requirements
dl "$cache/nvidia" $NVIDIA
# shellcheck disable=SC2086
dl "$cache/trl" $TRL
mkdir -p .whl && cp "$cache/trl"/*.whl .whl/

export PACK=${PACK:-gzip}  # xz packs ~25% smaller (fewer parts to ship) at ~40 minutes of two cores
GPU_WHEELS="$cache/wheels" GPU_PARTS=.gpu33 bash benchmarks/stage_site.sh
# The NVIDIA wheels go as they are (a tar of them, split): xz packs their libraries only ~10% smaller
# than the wheels' own zip, at ~40 minutes of two cores. gpu.sh's stage_install pip-installs them.
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
rm -rf .gpu33n && mkdir -p .gpu33n
tar cf - -C "$cache" nvidia | split -b $(( (62 << 20) - tree )) -d -a 2 - .gpu33n/p
n=0
for f in .gpu33n/p??; do mkdir -p ".gpu33n/x-$n"; mv "$f" ".gpu33n/x-$n/p"; n=$((n + 1)); done
echo "staged the NVIDIA wheels as $n parts: .gpu33n/x-0 .. .gpu33n/x-$((n - 1))"
