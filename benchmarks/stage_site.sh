#!/usr/bin/env bash
# Stage the GPU stack for the device machine as an installed tree rather than wheels: the wheels
# that ../shared/gpu/stage downloaded (its cache, ~/.cache/gpu-wheels/selected) installed here
# for CPython 3.12 x86-64 into `site/`, less what nothing of ours loads (xgrammar's static
# library, Ray's Java jar, the dashboard's source maps, vLLM's Rust front end), then tar + xz.
# 418 MiB of wheels (11 transfers) become ~250 MiB (docs/testing.md says how many transfers).
#
#   bash benchmarks/stage_site.sh          # writes .gpu/x-0/p, .gpu/x-1/p, ... (git-ignored)
#
# Each part goes in one call of the device tool, carrying .gpu/x-K:
#   mkdir -p /root/wc && mv .gpu/x-K/p /root/wc/pK
# and gpu_lib.sh's stage_install sees the xz stream (by its magic bytes) and unpacks it to /root/site.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_WHEELS:-$HOME/.cache/gpu-wheels/selected/wheels}
[ -d "$wheels" ] || { echo "no wheels in $wheels: run ../shared/gpu/stage first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 \
         manylinux1_x86_64 linux_x86_64; do plat+=(--platform "$p"); done
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" --target "$work/site" "$wheels"/*.whl
rm -rf "$work/site/xgrammar/lib/libxgrammar.a" "$work/site/vllm/vllm-rs" "$work/site/ray/jars"
find "$work/site/ray/dashboard" -name '*.map' -delete
# A transfer holds 64 MiB with the tracked tree: each part is what is left, less 2 MiB of slack.
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
part=$(( (62 << 20) - tree ))
rm -rf .gpu/x-*
mkdir -p .gpu
tar cf - -C "$work" site | xz -T0 -6 | split -b "$part" -d -a 2 - "$work/p"
n=0
for f in "$work"/p??; do mkdir -p ".gpu/x-$n"; mv "$f" ".gpu/x-$n/p"; n=$((n + 1)); done
bytes=$(du -cb .gpu/x-*/p | tail -1 | cut -f1)
echo "staged $((bytes >> 20)) MiB as $n parts of at most $((part >> 20)) MiB: .gpu/x-0 .. .gpu/x-$((n - 1))"
