#!/usr/bin/env bash
# Stage the GPU stack for the device machine as an installed tree rather than wheels: the wheels
# that ../shared/gpu/stage downloaded (its cache, ~/.cache/gpu-wheels/selected) installed here
# for CPython 3.12 x86-64 into `site/`, less what nothing of ours loads (xgrammar's static
# library, Ray's Java jar, the dashboard's source maps, vLLM's Rust front end), then tar + xz.
# 418 MiB of wheels (11 transfers) become ~250 MiB (docs/testing.md says how many transfers).
#
#   bash benchmarks/stage_site.sh          # writes .gpu/x-0/p, .gpu/x-1/p, ... (git-ignored)
#   GPU_WHEELS=~/.cache/gpu-wheels33/wheels GPU_PARTS=.gpu33 bash benchmarks/stage_site.sh
#                                          # another set of wheels (benchmarks/gpu_stack.lock) to .gpu33/x-K/p
#
# Each part goes in one call of the device tool, carrying .gpu/x-K:
#   mkdir -p /root/wc && mv .gpu/x-K/p /root/wc/pK
# and gpu.sh's stage_install sees the xz stream (by its magic bytes) and unpacks it to /root/site.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_WHEELS:-$HOME/.cache/gpu-wheels/selected/wheels}
parts=${GPU_PARTS:-.gpu}  # where the parts go, relative to the checkout (add it to .git/info/exclude)
[ -d "$wheels" ] || { echo "no wheels in $wheels: run ../shared/gpu/stage first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Every manylinux tag up to glibc 2.35 (the GPU machine has 2.39): nvidia-nccl-cu13 2.30.7 is manylinux_2_18 only.
plat=(--platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
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
# A transfer holds 64 MiB with the tracked tree: each part is what is left, less 2 MiB of slack.
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
part=$(( (62 << 20) - tree ))
rm -rf "$parts"/x-*
mkdir -p "$parts"
# PACK=gzip: ~25% more parts, at a few minutes of one core instead of ~40 of two (xz -6)
if [ "${PACK:-xz}" = gzip ]; then pack=(gzip -6); else pack=(xz -T0 "${XZ_LEVEL:--6}"); fi
tar cf - -C "$work" site | "${pack[@]}" | split -b "$part" -d -a 2 - "$work/p"
n=0
for f in "$work"/p??; do mkdir -p "$parts/x-$n"; mv "$f" "$parts/x-$n/p"; n=$((n + 1)); done
bytes=$(du -cb "$parts"/x-*/p | tail -1 | cut -f1)
echo "staged $((bytes >> 20)) MiB as $n parts of at most $((part >> 20)) MiB: $parts/x-0 .. $parts/x-$((n - 1))"
