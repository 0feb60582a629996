# Sourced by the GPU session scripts (gpu_i16.sh, gpu_i17.sh) from the repository root, after
# STAGE is set: the stack of ../shared/gpu/README.md in /root/site, offline, and $OUT/$STAGE.
export PYTHONPATH=/root/site:$PWD PATH=/root/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=1
# The image's own packages (torch, transformers, ... in /opt/torch/.venv) have no usable bytecode
# cache: every process compiled ~2,300 of their modules from source (cProfile of vLLM's import,
# 2026-11-27: builtins.compile 6.4-7.3 s of it, in a plain process and in a Ray actor alike).
# Bytecode goes to a tree of its own instead (stage_install fills it); a user's installed packages
# have theirs, so a start-up measured without this measured this image, not xrlhf.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/root/pycache
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT/$STAGE"
