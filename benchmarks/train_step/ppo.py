"""PPO step time and GPU memory, co-located layout (configs/gpu/ppo_vllm_colocate.yaml).

Runs the config for ``--steps`` steps (20) with the trainer below, which adds to each step's
metrics the peak memory of the step: the GPU's used memory sampled by nvidia-smi every 50 ms
(everything: vLLM's engine process, the trainers, CUDA contexts) and the sum over the Ray
workers of ``torch.cuda.max_memory_allocated`` (reset every step). Writes ``ppo_step.json``:
per step ``generate_s``, ``infer_s``, ``train_s``, ``sync_s``, ``sleep_s``, ``step_s`` and the
peaks, the medians over steps 2.., and the memory of the last step against step 2 (target:
within 5%).

    python -m benchmarks.train_step ppo --out benchmarks/results [key.path=value ...]

Weight verification is off here (``--verify`` to keep the config's), so ``sync_s`` is the
transport's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from xrlhf.algorithms import ALGORITHMS, RLTrainer

SAMPLER = None  # the DeviceMemorySampler of this run, set by main() on the imported module


class MemoryLoop(RLTrainer):
    """The online loop whose every step also reports its peak GPU memory (``mem/...`` metrics)."""

    def step(self) -> dict[str, float]:
        if SAMPLER is not None:
            SAMPLER.reset()
        metrics = super().step()
        torch_peak = 0.0
        for name in ("policy", "critic", "reference", "rollout"):
            handle = self.handles.get(name)
            if handle is not None:
                torch_peak += sum(s.get("max_allocated_gb", 0.0) for s in handle.memory_stats())
        metrics["mem/torch_peak_gb"] = torch_peak
        if SAMPLER is not None:
            metrics["mem/device_peak_gb"] = SAMPLER.peak()
        return metrics



MemoryPPO = replace(ALGORITHMS.get("ppo"), loop=MemoryLoop)
"""PPO run by ``MemoryLoop`` (``algorithm.name: benchmarks.train_step.ppo:MemoryPPO``)."""

KEYS = {"generate_s": "time/generate_s", "infer_s": "time/infer_s", "train_s": "time/train_s",
        "sync_s": "time/sync_s", "sleep_s": "time/sleep_s", "step_s": "time/step_s",
        "device_peak_gb": "mem/device_peak_gb", "torch_peak_gb": "mem/torch_peak_gb",
        "mismatch_mean": "mismatch/logprob_abs_diff_mean", "mismatch_max": "mismatch/logprob_abs_diff_max"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_step ppo", description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", default="configs/gpu/ppo_vllm_colocate.yaml")
    p.add_argument("--model", default=None, help="default: artifacts/model-0.5b (built if missing)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--verify", action="store_true", help="keep the config's weight_sync.verify")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    from benchmarks.common import (MODEL_05B, ROOT, DeviceMemorySampler, cli_overrides, ensure_model, gpu_name,
                                   table, write_json)
    from xrlhf.validation import load_config
    from xrlhf.runner import run

    model = ensure_model(args.model or MODEL_05B)
    overrides = [f"policy.model={model}", f"trainer.steps={args.steps}", "trainer.eval_size=32",
                 "algorithm.name=benchmarks.train_step.ppo:MemoryPPO", *cli_overrides(), *args.overrides]
    if not args.verify:
        overrides.append("policy.weight_sync.verify=false")
    cfg = load_config(ROOT / args.config, overrides)
    import benchmarks.train_step.ppo as this  # the module the config names

    this.SAMPLER = sampler = DeviceMemorySampler()
    run_dir = Path(tempfile.mkdtemp(prefix="ppo_step-"))
    try:
        run(cfg, run_dir)
    finally:
        sampler.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{"step": r["step"], **{k: r.get(v) for k, v in KEYS.items()}} for r in rows if "reward/mean" in r]
    later = steps[1:] or steps
    medians = {k: statistics.median(s[k] for s in later if s[k] is not None) for k in KEYS
               if any(s[k] is not None for s in later)}
    memory = {}
    if len(steps) >= 2:
        for k in ("device_peak_gb", "torch_peak_gb"):
            memory[k.replace("_gb", "_last_over_step2")] = steps[-1][k] / steps[1][k]
    result = {"gpu": gpu_name(), "config": args.config, "steps": len(steps), "verify": bool(args.verify),
              "prompts_per_step": cfg.trainer.prompts_per_step, "max_new_tokens": cfg.policy.generate.max_new_tokens,
              "transport": "auto", "median_from_step_2": medians, "memory_ratio": memory, "per_step": steps,
              "overrides": overrides, "run_dir": str(run_dir)}
    write_json(args.out, "ppo_step.json", result)
    cols = ["generate_s", "infer_s", "train_s", "sync_s", "sleep_s", "step_s", "device_peak_gb", "torch_peak_gb"]
    print(table([[s["step"], *[s[c] for c in cols]] for s in steps], ["step", *cols]))
    print(f"{result['gpu']}: medians from step 2 " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    print("memory of the last step / step 2: " + ", ".join(f"{k} {v:.3f}" for k, v in memory.items())
          + " (target within 5%)")
