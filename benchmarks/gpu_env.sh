# Sourced by the GPU session scripts (gpu_i16.sh, gpu_i17.sh) from the repository root, after
# STAGE is set: the stack of ../shared/gpu/README.md in /root/site, offline, and $OUT/$STAGE.
export PYTHONPATH=/root/site:$PWD PATH=/root/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT/$STAGE"
