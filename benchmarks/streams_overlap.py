"""One process, two CUDA streams: does vLLM's generation overlap W's update when both live in the
same process (one CUDA context, so the GPU may run their kernels at once)? Issue 25, item 4's
other way besides MPS, whose SM limits make cuBLAS wrong (docs/async.md).

In one process:

* a thread of its own builds W's vLLM engine in process (``VLLMGenerateEngine``, the engine
  core's loop on that thread, vLLM awake) with that thread's current CUDA stream set first, of
  priority ``--gen-priority`` (CUDA: lower is more urgent; 0 is the default stream's), so every
  kernel of its ``vllm.LLM.generate`` goes to that stream;
* the main thread holds W's policy trainer as W ships it (mixed precision, compiled layers,
  derived budgets) and runs the update on a stream of its own (priority 0): one train step on
  W's batch and one logprob forward (the reference's phase, computed by the same model).

Each round times generation alone (512 x 256 tokens, W's shape, no logprobs), the update alone,
then both at once (generation started, then the update). Reported per round and as medians:
``both_s`` (the wall of the two together), ``serial_s`` (the two alone, summed) and
``overlap = serial_s / both_s`` (1: they took turns; ``serial_s / max(alone)``: perfect overlap),
with each side's time beside the other. The GIL is shared: both sides' Python runs in one
interpreter. On the GPU machine::

    python -m benchmarks.streams_overlap --gen-priority -1 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Any


class Generator(threading.Thread):
    """vLLM built and driven on this thread, its kernels on a stream of ``priority``."""

    def __init__(self, model: str, prompts: list[list[int]], new_tokens: int, priority: int):
        super().__init__(name="generator", daemon=True)
        self.model, self.prompts, self.new_tokens, self.priority = model, prompts, new_tokens, priority
        self.ready = threading.Event()
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        import torch

        from benchmarks.generation_bench import raw_vllm, vllm_engine
        try:
            torch.cuda.set_stream(torch.cuda.Stream(priority=self.priority))
            engine, _ = vllm_engine(self.model, len(self.prompts), 0.3, sleep_level=0, max_model_len=512,
                                    kv_cache_tokens="batch")
            raw_vllm(engine.llm, self.prompts[:64], 32, None)
            torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        while self.jobs.get() is not None:
            t0 = time.perf_counter()
            raw_vllm(engine.llm, self.prompts, self.new_tokens, None)
            torch.cuda.current_stream().synchronize()
            self.done.put((t0, time.perf_counter()))

    def generate(self) -> None:
        self.jobs.put(1)

    def wait(self) -> tuple[float, float]:
        return self.done.get(timeout=600)


def update(policy: Any, batch: Any, loss: Any, stream: Any) -> tuple[float, float]:
    """W's update on ``stream``: one train step and one logprob forward; (start, end)."""
    import torch

    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        policy.train_step(batch, loss)
        policy.infer(batch.select("input_ids", "attention_mask", "response_mask"))
        stream.synchronize()
    return t0, time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen-priority", type=int, default=-1, help="the generator's stream priority (0: as the trainer's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    import torch
    from transformers import AutoConfig

    from benchmarks.common import ensure_model
    from benchmarks.generation_bench import prompts_for
    from benchmarks.train_efficiency import W, make_batch, precision_policy, w_loss

    model = ensure_model()
    gen = Generator(model, prompts_for(model, 512, 8), args.new_tokens, args.gen_priority)
    t0 = time.perf_counter()
    gen.start()
    gen.ready.wait()
    if gen.error is not None:
        raise gen.error
    priorities = getattr(torch.cuda.Stream, "priority_range", lambda: None)()
    print(f"vLLM ready in {time.perf_counter() - t0:.1f} s (stream priority {args.gen_priority}; CUDA's range "
          f"{priorities})", flush=True)
    policy = precision_policy(model, "cuda", "mixed", compile=True)
    batch, loss, stream = make_batch(W, AutoConfig.from_pretrained(model).vocab_size), w_loss(), torch.cuda.Stream()
    for _ in range(2):  # compiles, then warm
        update(policy, batch, loss, stream)
    rounds = []
    for r in range(args.rounds):
        gen.generate()
        g0, g1 = gen.wait()
        u0, u1 = update(policy, batch, loss, stream)
        gen.generate()
        time.sleep(0.05)  # generation under way first, as one step off has it
        b0, b1 = update(policy, batch, loss, stream)
        c0, c1 = gen.wait()
        row = {"gen_alone_s": g1 - g0, "update_alone_s": u1 - u0, "gen_beside_s": c1 - c0,
               "update_beside_s": b1 - b0, "both_s": max(c1, b1) - min(c0, b0)}
        row["serial_s"] = row["gen_alone_s"] + row["update_alone_s"]
        row["overlap"] = row["serial_s"] / row["both_s"]
        row = {k: round(v, 3) for k, v in row.items()}
        rounds.append(row)
        print(f"round {r}: {row}", flush=True)
    gen.jobs.put(None)
    medians = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    out = {"gpu": torch.cuda.get_device_name(), "gen_priority": args.gen_priority, "rounds": rounds, "median": medians,
           "command": f"python -m benchmarks.streams_overlap --gen-priority {args.gen_priority}"}
    print(f"median: {medians}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"streams_overlap_p{args.gen_priority}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
