# Sourced by the GPU session scripts (gpu_i25.sh, gpu_i29.sh) from the repository root after
# STAGE is set: the environment of gpu_env.sh, a step log, `run` (one command under a time limit,
# logged to $OUT/NAME.log, its tail shown) and `stage_setup` (the stack of ../shared/gpu/README.md,
# shipped to /root/wc as parts p0, p1, ... (docs/testing.md), installed to /root/site and byte-compiled; W's model built).
# At most 8 files come back from the device tool, so the scripts write into a temporary $OUT and
# pack it into one archive in $FINAL at the end.
source benchmarks/gpu_env.sh
FINAL=$OUT
OUT=$(mktemp -d "/tmp/$STAGE-XXXX")
T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }

run() {  # run NAME LIMIT CMD...: under timeout, logged to $OUT/NAME.log, the tail shown
  local name=$1 limit=$2 t
  shift 2
  t=$(date +%s)
  log "$name: $* (limit ${limit}s)"
  PYTHONUNBUFFERED=1 timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  log "$name: exit $? after $(( $(date +%s) - t ))s"
  grep -v "^\s*$" "$OUT/$name.log" | grep -E -v "it/s\]|Loading weights|^\s+warnings.warn" | tail -${TAIL:-12} | cut -c1-260
}

stage_setup() {  # the stack installed, W's model built
  stage_install
  if [ ! -f artifacts/model-0.5b/config.json ]; then
    run model 120 python -m xrlhf.cli make-tiny-model artifacts/model-0.5b --preset 0.5b --dtype bfloat16
  fi
}

stage_install() {  # the stack alone (what needs no model)
  if [ ! -d /root/site/vllm ]; then
    log "installing the stack"
    if [ "$(cd /root/wc && cat $(ls p* | sort -V) | head -c 6 | od -An -tx1 | tr -d ' ')" = "fd377a585a00" ]; then
      # the stack installed here beforehand (benchmarks/stage_site.sh: `site/` as xz, ~2x smaller than its wheels)
      (cd /root/wc && cat $(ls p* | sort -V) | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, \
        mode='r|xz').extractall('/root', filter='fully_trusted')" && rm -f p* && \
        grep -l '^#!.*python' /root/site/bin/* | xargs sed -i '1s|^#!.*python.*|#!/usr/bin/env python3|' && \
        echo installed) 2>&1 | tail -2
    else
      (cd /root/wc && cat $(ls p* | sort -V) > s.tar && tar xf s.tar && rm -f s.tar p* && \
        python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site wheels/*.whl && echo installed) \
        2>&1 | tail -2
    fi
    log "installed"
  fi
  if ls /root/wcn/p* >/dev/null 2>&1; then  # a second xz stream of site/ (torch's nvidia libraries), unpacked over it
    (cd /root/wcn && cat $(ls p* | sort -V) | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, \
      mode='r|xz').extractall('/root', filter='fully_trusted')" && rm -f p* && echo "libraries installed") 2>&1 | tail -2
  fi
  # Byte-compiled like any installed stack (pip --no-compile above), and the image's packages too
  # (gpu_env.sh says why): `import vllm` reads .pyc, not source, in every start-up measured after
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
