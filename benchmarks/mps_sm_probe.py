"""One train step and one logprob forward of W's policy under an MPS daemon's SM limit: are they
finite? (2026-11-26d: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of 74-80% gave NaN, eager or compiled,
with no other client; 50, 60, 70, 90 and 100% gave the unlimited step's loss.)

On the GPU machine, with a daemon of one's own (``CUDA_MPS_PIPE_DIRECTORY``)::

    CUDA_MPS_PIPE_DIRECTORY=$P nvidia-cuda-mps-control -d
    CUDA_MPS_PIPE_DIRECTORY=$P CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75 python -m benchmarks.mps_sm_probe --compile 0
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import ensure_model
from benchmarks.train_efficiency import W, make_batch, precision_policy, w_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", type=int, default=0, help="1: compiled layers")
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    from transformers import AutoConfig

    model = ensure_model()
    batch = make_batch(W, AutoConfig.from_pretrained(model).vocab_size)
    policy = precision_policy(model, "cuda", "mixed", compile=bool(args.compile))
    inputs = batch.select("input_ids", "attention_mask", "response_mask")
    print("SMs", torch.cuda.get_device_properties(0).multi_processor_count, flush=True)
    for i in range(args.steps):
        metrics = policy.train_step(batch, w_loss())
        logprobs = policy.infer(inputs)["logprobs"]
        print(f"compile={bool(args.compile)} step {i}: loss {metrics['loss']:.5f} finite logprobs "
              f"{bool(torch.isfinite(logprobs).all())}", flush=True)


if __name__ == "__main__":
    main()
