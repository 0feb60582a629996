"""TRL's GRPOTrainer on workload W (and W2, W7 by its options), for a side-by-side figure against
xrlhf on the same GPUs. A copy of ../shared/bench/trl_grpo.py, extended for several GPUs: under
``accelerate launch`` (TRL's multi-GPU recipe: ``benchmarks/trl_zero3.yaml``, TRL's
examples/accelerate_configs/deepspeed_zero3.yaml) each process trains a ZeRO-3 shard and runs its
own co-located vLLM; one optimizer step still takes the whole batch (the gradient accumulation is
divided by the processes). Rank 0 writes the files.

TRL 1.16.0 GRPOTrainer, one GPU, vLLM co-located in the trainer's process (vllm_mode="colocate",
vLLM's external_launcher), sleep mode on, a reference model with beta 0.04. Same model directory,
prompts, sequence counts and lengths as xrlhf's configs/gpu/grpo_w.yaml: 64 prompts x 8 samples =
512 sequences per step, up to 256 new tokens, one optimizer step per generation batch (16
micro-batches of 32), constant lr 1e-6, AdamW, clip 1.0.

Prompts: the first steps*64 prompts of xrlhf's ``reasoning`` env training stream (seed 0, tasks
add/compare/sort/parity), in order (shuffle off); "<s>" is put in front of the text so that the
prompt ids equal xrlhf's (BOS + text: the locally built tokenizer adds no special tokens itself).
Reward: xrlhf's own rule (ReasoningEnv.score). So xrlhf must be importable (PYTHONPATH).

--dtype bfloat16 (default): pure bf16 weights and AdamW states, as xrlhf with
policy.train.mixed_precision=false. --dtype float32: TRL's own default (fp32 weights, bf16
autocast), to set beside xrlhf's default mixed precision.

Writes to --out: steps.jsonl (per optimizer step: wall time from on_step_begin to on_step_end
with a CUDA sync, torch peak memory of this process, TRL's profiling events), logs.jsonl (TRL's
logged metrics), summary.json. The step time to compare is the median of steps 3..10 of
steps.jsonl's step_s.

    python trl_grpo.py --model artifacts/model-0.5b --out OUT/trl [--dtype float32]
    accelerate launch --config_file benchmarks/trl_zero3.yaml --num_processes 4 benchmarks/trl_grpo.py \
        --model artifacts/model-7b --max-new-tokens 512 --max-model-len 640 --micro-batch 8 --out OUT/trl   # W7
    python trl_grpo.py --model DIR --out DIR --smoke   # CPU check: no vLLM, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="weights as loaded: bfloat16 (pure bf16) or float32 (TRL's default: bf16 autocast)")
    p.add_argument("--smoke", action="store_true", help="CPU: no vLLM, no bf16")
    args = p.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))  # accelerate launch sets them
    # vLLM's external_launcher needs the torch.distributed rendezvous variables; TRL 1.16 sets
    # RANK/LOCAL_RANK/WORLD_SIZE itself before building vLLM (VLLMGeneration._init_vllm) and keeps
    # MASTER_ADDR/MASTER_PORT if set. RANK etc. are left unset here so that accelerate runs the
    # trainer undistributed (no DDP wrapper around a world of one).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    import trl
    import trl.extras.profiling as prof
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from xrlhf.envs import build_env
    from xrlhf.envs.base import Prompt

    # -- TRL's own profiling events (it only reports them to wandb/mlflow/trackio): keep them --
    events: list[tuple[str, float, float]] = []
    orig_exit = prof.ProfilingContext.__exit__

    def exit_and_record(self, *exc):
        if self._start_time is not None:
            events.append((self.name, self._start_time, time.perf_counter() - self._start_time))
        return orig_exit(self, *exc)

    prof.ProfilingContext.__exit__ = exit_and_record

    # -- prompts and reward: xrlhf's reasoning env -------------------------------------------
    env = build_env("reasoning", {"tasks": ["add", "compare", "sort", "parity"], "max_operand": 20,
                                  "eval_size": 256}, seed=0)
    prompts = env.train_prompts(0, args.steps * args.prompts_per_step)
    ds = Dataset.from_list([{"prompt": "<s>" + q.text, "text": q.text, "answer": q.answer, "task": q.task,
                             "index": q.index} for q in prompts])

    def reasoning_reward(prompts, completions, text, answer, task, index, **kwargs):
        ps = [Prompt(text=t, answer=a, task=k, index=i) for t, a, k, i in zip(text, answer, task, index)]
        return [s.reward for s in env.score(ps, list(completions))]

    batch = args.prompts_per_step * args.samples
    if batch % (args.micro_batch * world):
        sys.exit(f"prompts_per_step*samples = {batch} must divide by micro-batch {args.micro_batch} x {world} processes")
    ga = batch // (args.micro_batch * world)
    cuda = torch.cuda.is_available() and not args.smoke
    cfg = GRPOConfig(
        output_dir=str(out / "trainer"),
        # the model's weights: bfloat16 (pure bf16) or float32 (TRL's default, bf16 autocast)
        model_init_kwargs={"dtype": args.dtype} if cuda else {"dtype": "float32"},
        bf16=cuda,
        use_cpu=not cuda,
        # generation: vLLM co-located, sleep mode, same memory share as xrlhf
        use_vllm=cuda,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_enable_sleep_mode=True,
        vllm_max_model_length=args.max_model_len,
        num_generations=args.samples,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        # one optimizer step per generation batch of 512 sequences
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=ga,
        steps_per_generation=ga,
        num_iterations=1,
        # loss: GRPO group-normalised advantages, clipped ratio 0.2, k3 KL to a reference, beta 0.04
        beta=0.04,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="dapo",              # TRL's default: token sum / tokens of the global batch (xrlhf: same)
        # optimiser: as xrlhf's HF engine (torch AdamW, constant lr, clip 1.0, no decay)
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        gradient_checkpointing=args.gradient_checkpointing,
        # data and bookkeeping
        shuffle_dataset=False,
        seed=0,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        log_completions=False,
        disable_tqdm=True,
    )

    suffix = "" if rank == 0 else f"-rank{rank}"  # every rank times its steps; rank 0's are the figure
    steps_f = open(out / f"steps{suffix}.jsonl", "w")
    logs_f = open(out / f"logs{suffix}.jsonl", "w")

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t_begin = None
            self.t_prev_end = None
            self.t_train_begin = None

        def _sync(self):
            if cuda:
                torch.cuda.synchronize()

        def on_train_begin(self, args_, state, control, **kw):
            self._sync()
            self.t_train_begin = self.t_prev_end = time.perf_counter()

        def on_step_begin(self, args_, state, control, **kw):
            self._sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.t_begin = time.perf_counter()
            self.n_events = len(events)

        def on_step_end(self, args_, state, control, **kw):
            self._sync()
            t = time.perf_counter()
            row = {"step": state.global_step, "t_begin": self.t_begin, "t_end": t, "wall_time": time.time(),
                   "step_s": t - self.t_begin, "end_to_end_s": t - self.t_prev_end,
                   "events": [(n, round(s - self.t_begin, 4), round(d, 4)) for n, s, d in events[self.n_events:]]}
            if cuda:
                row["torch_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
                row["torch_max_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
            steps_f.write(json.dumps(row) + "\n")
            steps_f.flush()
            print(f"[trl-step] {state.global_step} {row['step_s']:.3f}s (end-to-end {row['end_to_end_s']:.3f}s)",
                  flush=True)
            self.t_prev_end = t

        def on_log(self, args_, state, control, logs=None, **kw):
            logs_f.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")
            logs_f.flush()

    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reasoning_reward, args=cfg, train_dataset=ds,
                          callbacks=[StepTimer()])
    t_init = time.perf_counter() - t0
    print(f"[trl] trainer + vLLM built in {t_init:.1f}s; generation_batch_size {cfg.generation_batch_size}, "
          f"steps_per_generation {cfg.steps_per_generation}, grad accumulation {cfg.gradient_accumulation_steps}, "
          f"policy dtype {trainer.model.dtype}, ref {'yes' if trainer.ref_model is not None else 'no'}", flush=True)
    t1 = time.perf_counter()
    trainer.train()
    t_train = time.perf_counter() - t1
    summary = {"trl": trl.__version__, "torch": torch.__version__, "init_s": t_init, "train_s": t_train,
               "generation_batch_size": cfg.generation_batch_size, "steps_per_generation": cfg.steps_per_generation,
               "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
               "per_device_train_batch_size": cfg.per_device_train_batch_size, "max_steps": cfg.max_steps,
               "processes": world,
               "policy_dtype": str(trainer.model.dtype), "gradient_checkpointing": cfg.gradient_checkpointing,
               "optim": str(cfg.optim), "vllm_importance_sampling_mode": cfg.vllm_importance_sampling_mode,
               "n_prompts": len(ds), "first_prompts": [r["prompt"] for r in ds.select(range(3))]}
    if cuda:
        summary["gpu"] = torch.cuda.get_device_name(0)
        summary["torch_max_allocated_gb_run"] = torch.cuda.max_memory_allocated() / 2**30
        try:
            import vllm
            summary["vllm"] = vllm.__version__
        except ImportError:
            pass
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[trl] done: train {t_train:.1f}s", flush=True)
    steps_f.close()
    logs_f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
