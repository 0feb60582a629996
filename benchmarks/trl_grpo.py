"""TRL's GRPOTrainer, the side of xrlhf's comparisons with TRL: W's step time (``w``, the default,
run by ``benchmarks.w_vs_trl``) and the learning recipe's eval reward against wall-clock
(``learn``, run by ``benchmarks.learning_gpu --trl``).

    python benchmarks/trl_grpo.py [w] --model artifacts/model-0.5b --out OUT/trl [--dtype float32]
    accelerate launch --config_file benchmarks/trl_zero3.yaml --num_processes 4 benchmarks/trl_grpo.py \
        --model artifacts/model-7b --max-new-tokens 512 --max-model-len 640 --micro-batch 8 --out OUT/trl   # W7
    python benchmarks/trl_grpo.py --model DIR --out DIR --smoke   # CPU check: no vLLM, tiny sizes
    python benchmarks/trl_grpo.py learn --model runs/learning_gpu/warmup --out OUT/trl [--set seed=1]
    python benchmarks/trl_grpo.py learn --model DIR --out DIR --smoke --set ...   # CPU: no vLLM, no bf16

**w**: workload W (and W2, W7 by its options), for a side-by-side step time against xrlhf on the
same GPUs. A copy of ../shared/bench/trl_grpo.py, extended for several GPUs: under
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

**learn**: xrlhf's learning recipe, for a time-to-reward figure beside xrlhf (issue 51, item 3).
W's harness turned to learning: TRL 1.16.0's
GRPOTrainer, one GPU, vLLM co-located in the trainer's process with sleep mode, started from the
model xrlhf's warm-up wrote (``--model``). What the workload fixes is read from xrlhf's recipe
(``--config``, default configs/gpu/grpo_learn.yaml, with ``--set`` overrides as the xrlhf run had):

* data: the env's training stream, positions 0 .. steps x prompts_per_step - 1, in xrlhf's order
  (``shuffle_dataset=False``), and its held-out prompts for the eval: the same rows of the same
  jsonl, the same split; "<s>" in front of each prompt's text so that TRL's ids equal xrlhf's
  (BOS + text: the locally built tokenizer adds no special token itself);
* reward: xrlhf's verifier (``xrlhf.envs.verifiers.load_verifier``: ``numeric``) on the
  completion as xrlhf's env gives it (``clean_response``);
* shape: samples_per_prompt completions per prompt, prompts_per_step x samples_per_prompt
  sequences and one optimizer step per generation batch, max_new_tokens, vLLM's max_model_len
  and memory share, temperature; lr (constant), beta = kl_coef (TRL's KL is k3, a loss term).

Everything else stays TRL's default: fp32 weights under bf16 autocast, the "dapo" loss, group
reward scaling, clip 0.2, vLLM importance-sampling correction, AdamW. The micro-batch
(``--micro-batch``, 64: ~7k tokens of these <= 110-token sequences, about the tokens of W's TRL
micro-batch of 32) is a memory choice the workload leaves open.

Eval: greedy (temperature 0) on the held-out prompts through TRL's own vLLM engine (its
``generate``, which pushes the current weights after a sleep), before the first step, every
``trainer.eval_every`` steps and after the last. Its time is measured and left out of TRL's clock
(xrlhf's clock includes its own evaluations: the comparison is conservative for xrlhf).

Writes to --out: evals.jsonl (step, eval_reward, per-task rewards, rl_s: seconds of training since
``on_train_begin`` less the evaluations, eval_s), steps.jsonl (per optimizer step), logs.jsonl (TRL's
metrics), summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# -- both: TRL's profiling events, the environment, the step timer -----------------------------
def record_profiling(events: list) -> None:
    """TRL's own profiling events (it reports them to wandb/mlflow/trackio only) into ``events``."""
    import trl.extras.profiling as prof

    orig_exit = prof.ProfilingContext.__exit__

    def exit_and_record(self, *exc):
        if self._start_time is not None:
            events.append((self.name, self._start_time, time.perf_counter() - self._start_time))
        return orig_exit(self, *exc)

    prof.ProfilingContext.__exit__ = exit_and_record


def set_environment() -> None:
    """vLLM's external_launcher needs the rendezvous variables; TRL 1.16 sets RANK/LOCAL_RANK/
    WORLD_SIZE itself before building vLLM and keeps MASTER_ADDR/PORT if set (RANK etc. unset here:
    accelerate runs the trainer undistributed). Offline, quiet."""
    quiet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key, value in quiet.items():
        os.environ.setdefault(key, value)


def gpu_versions(torch) -> dict[str, str]:
    """The GPU's name and vLLM's version (when importable), for a summary."""
    out = {"gpu": torch.cuda.get_device_name(0)}
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except ImportError:
        pass
    return out


def step_timer(out: Path, cuda: bool, events: list, suffix: str = ""):
    """A TrainerCallback writing ``steps<suffix>.jsonl`` (each optimizer step's wall time from
    on_step_begin to on_step_end with a CUDA sync, the time since the last step's end, TRL's
    profiling events in it, this process's peak memory) and ``logs<suffix>.jsonl`` (TRL's metrics)."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps_f = open(out / f"steps{suffix}.jsonl", "w")
            self.logs_f = open(out / f"logs{suffix}.jsonl", "w")
            self.t_begin = self.t_prev_end = self.n_events = 0

        def _sync(self):
            if cuda:
                torch.cuda.synchronize()

        def on_train_begin(self, args_, state, control, **kw):
            self._sync()
            self.t_prev_end = time.perf_counter()

        def on_step_begin(self, args_, state, control, **kw):
            self._sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.t_begin, self.n_events = time.perf_counter(), len(events)

        def on_step_end(self, args_, state, control, **kw):
            self._sync()
            t = time.perf_counter()
            row = {"step": state.global_step, "t_begin": self.t_begin, "t_end": t, "wall_time": time.time(),
                   "step_s": t - self.t_begin, "end_to_end_s": t - self.t_prev_end,
                   "events": [(n, round(s - self.t_begin, 4), round(d, 4)) for n, s, d in events[self.n_events:]]}
            if cuda:
                row["torch_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
                row["torch_max_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
            self.steps_f.write(json.dumps(row) + "\n")
            self.steps_f.flush()
            print(f"[trl-step] {state.global_step} {row['step_s']:.3f}s (end-to-end {row['end_to_end_s']:.3f}s)",
                  flush=True)
            self.t_prev_end = t

        def on_log(self, args_, state, control, logs=None, **kw):
            self.logs_f.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")
            self.logs_f.flush()

        def on_train_end(self, args_, state, control, **kw):
            self.steps_f.close()
            self.logs_f.close()

    return StepTimer()


# -- w: W's step time ---------------------------------------------------------------------------
def w_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trl_grpo.py [w]", description="TRL's GRPOTrainer on workload W")
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
    return p.parse_args(argv)


def w_data(args: argparse.Namespace):
    """``(Dataset, reward function)``: the first steps x prompts_per_step prompts of xrlhf's
    reasoning env (seed 0) in order, scored by its own rule."""
    from datasets import Dataset

    from xrlhf.envs import build_env
    from xrlhf.envs.base import Prompt

    env = build_env("reasoning", {"tasks": ["add", "compare", "sort", "parity"], "max_operand": 20,
                                  "eval_size": 256}, seed=0)
    prompts = env.train_prompts(0, args.steps * args.prompts_per_step)
    ds = Dataset.from_list([{"prompt": "<s>" + q.text, "text": q.text, "answer": q.answer, "task": q.task,
                             "index": q.index} for q in prompts])

    def reasoning_reward(prompts, completions, text, answer, task, index, **kwargs):
        ps = [Prompt(text=t, answer=a, task=k, index=i) for t, a, k, i in zip(text, answer, task, index)]
        return [s.reward for s in env.score(ps, list(completions))]

    return ds, reasoning_reward


def w_config(args: argparse.Namespace, out: Path, cuda: bool, ga: int):
    """W's GRPOConfig: xrlhf's configs/gpu/grpo_w.yaml in TRL's terms (module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / "trainer"),
        # the model's weights: bfloat16 (pure bf16) or float32 (TRL's default, bf16 autocast)
        model_init_kwargs={"dtype": args.dtype} if cuda else {"dtype": "float32"},
        bf16=cuda, use_cpu=not cuda,
        # generation: vLLM co-located, sleep mode, same memory share as xrlhf
        use_vllm=cuda, vllm_mode="colocate", vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_enable_sleep_mode=True, vllm_max_model_length=args.max_model_len,
        num_generations=args.samples, max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        # one optimizer step per generation batch of 512 sequences
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=ga, steps_per_generation=ga,
        num_iterations=1,
        # loss: GRPO group-normalised advantages, clipped ratio 0.2, k3 KL to a reference, beta 0.04;
        # "dapo", TRL's default: token sum / tokens of the global batch (xrlhf: same)
        beta=0.04, epsilon=0.2, scale_rewards="group", loss_type="dapo",
        # optimiser: as xrlhf's HF engine (torch AdamW, constant lr, clip 1.0, no decay)
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        gradient_checkpointing=args.gradient_checkpointing,
        # data and bookkeeping
        shuffle_dataset=False, seed=0, max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no",
        eval_strategy="no", dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
    )


def w(argv: list[str] | None = None) -> int:
    args = w_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))  # accelerate launch sets them
    set_environment()
    import torch
    import trl
    from trl import GRPOTrainer

    events: list = []
    record_profiling(events)
    ds, reward = w_data(args)
    batch = args.prompts_per_step * args.samples
    if batch % (args.micro_batch * world):
        sys.exit(f"prompts_per_step*samples = {batch} must divide by micro-batch {args.micro_batch} x {world} processes")
    cuda = torch.cuda.is_available() and not args.smoke
    cfg = w_config(args, out, cuda, batch // (args.micro_batch * world))
    suffix = "" if rank == 0 else f"-rank{rank}"  # every rank times its steps; rank 0's are the figure
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=cfg, train_dataset=ds,
                          callbacks=[step_timer(out, cuda, events, suffix)])
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
        summary["torch_max_allocated_gb_run"] = torch.cuda.max_memory_allocated() / 2**30
        summary.update(gpu_versions(torch))
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[trl] done: train {t_train:.1f}s", flush=True)
    return 0


# -- learn: the learning recipe's eval reward against wall-clock --------------------------------
def learn_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trl_grpo.py learn", description="TRL's GRPOTrainer on xrlhf's learning recipe")
    p.add_argument("--model", required=True, help="the warmed-up model (xrlhf's RUN/warmup)")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu" / "grpo_learn.yaml"))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the recipe (seed=1 ...)")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights as loaded: float32 (TRL's default, bf16 autocast) or bfloat16 (pure bf16)")
    p.add_argument("--smoke", action="store_true", help="CPU: no vLLM, no bf16")
    return p.parse_args(argv)


def recipe(args: argparse.Namespace):
    """xrlhf's recipe with ``--set`` (and the warmed model) applied, checked section by section
    (not its engines: this process may lack vLLM, and builds none of xrlhf's)."""
    from xrlhf.config.loader import apply_overrides, read_yaml
    from xrlhf.config.schema import XConfig

    data = apply_overrides(read_yaml(args.config), [*args.set, f"policy.model={args.model}", "warmup.steps=0"])
    return XConfig.model_validate(data)


def workload_data(cfg, tokenizer):
    """``(train Dataset, eval prompt ids, eval prompts, verify, verifier name)`` from xrlhf's env of ``cfg``."""
    from datasets import Dataset

    from xrlhf.data.text import encode_prompt
    from xrlhf.envs import build_env
    from xrlhf.envs.verifiers import load_verifier

    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    t = cfg.trainer
    train = env.train_prompts(0, t.steps * t.prompts_per_step)
    ds = Dataset.from_list([{"prompt": "<s>" + q.text, "answer": q.answer, "task": q.task} for q in train])
    evals = env.eval_prompts()[:t.eval_size]
    options = env.config
    verify = load_verifier(options.verifier, options.verifier_options)
    return ds, [encode_prompt(tokenizer, q.text) for q in evals], evals, verify, options.verifier


def batch_shape(cfg) -> tuple[int, int, int]:
    """``(batch, mini-batch, epochs)`` of xrlhf's recipe: sequences per RL step, per optimizer step,
    and passes over each batch (``algorithm.mini_batch_size``, ``ppo_epochs``)."""
    o = cfg.algorithm.options()
    batch = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    return batch, o.get("mini_batch_size") or batch, o.get("ppo_epochs", 1)


def learn_config(args: argparse.Namespace, cfg, out: Path, cuda: bool):
    """TRL's config: what the workload fixes (module docstring), TRL's defaults otherwise."""
    from trl import GRPOConfig

    t, g = cfg.trainer, cfg.policy.generate
    batch, mini, epochs = batch_shape(cfg)
    if mini % args.micro_batch or batch % mini:
        sys.exit(f"the recipe's mini-batch {mini} must divide prompts_per_step x samples_per_prompt = {batch} "
                 f"and divide by --micro-batch {args.micro_batch}")
    if cfg.policy.train.lr_schedule != "constant":
        sys.exit(f"policy.train.lr_schedule={cfg.policy.train.lr_schedule}: only the constant schedule is mirrored")
    extra = g.engine_fields()  # the chosen backend's own options too (vLLM's)
    return GRPOConfig(
        output_dir=str(out / "trainer"),
        **({"model_init_kwargs": {"dtype": args.dtype}} if cuda and args.dtype != "float32" else {}),
        use_cpu=not cuda,
        bf16=cuda,
        use_vllm=cuda,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=extra.get("gpu_memory_utilization", 0.3),
        vllm_enable_sleep_mode=True,
        vllm_max_model_length=extra.get("max_model_len"),
        num_generations=t.samples_per_prompt,
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        per_device_train_batch_size=args.micro_batch,
        # xrlhf's updates of one batch: an optimizer step per mini-batch, ppo_epochs passes over it
        gradient_accumulation_steps=mini // args.micro_batch,
        steps_per_generation=batch // args.micro_batch,
        num_iterations=epochs,
        beta=cfg.algorithm.options().get("kl_coef", 0.0),
        learning_rate=cfg.policy.train.lr,
        # xrlhf's schedule: constant after a linear warm-up of lr_warmup_steps optimizer steps
        lr_scheduler_type="constant_with_warmup" if cfg.policy.train.lr_warmup_steps else "constant",
        warmup_steps=cfg.policy.train.lr_warmup_steps,
        shuffle_dataset=False,
        seed=cfg.seed,
        max_steps=t.steps * (batch // mini) * epochs,
        logging_steps=1,  # bookkeeping: a log row per step, nothing reported or saved
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )


def greedy_completions(trainer, prompt_ids: list[list[int]], max_new: int, tokenizer) -> list[list[int]]:
    """Greedy completions of ``prompt_ids``: through TRL's vLLM engine when it has one (its
    ``generate`` wakes it and pushes the current weights), else Transformers' ``generate``."""
    import torch

    vg = getattr(trainer, "vllm_generation", None) if trainer.use_vllm else None
    if vg is not None:
        old = vg.temperature
        vg.temperature = 0.0
        try:
            return [list(c) for c in vg.generate(prompts=prompt_ids, images=None, num_generations=1)[1]]
        finally:
            vg.temperature = old
    model = trainer.accelerator.unwrap_model(trainer.model)
    width = max(map(len, prompt_ids))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=model.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    model.train(was_training)
    return [row[width:].tolist() for row in out]


def eval_callback(cfg, prompt_ids, prompts, verify, tokenizer, path: Path, cuda: bool):
    """A TrainerCallback that evaluates before training, every ``eval_every`` steps and at the end,
    and keeps the clock of training without its own time (``rl_s``)."""
    import torch
    from transformers import TrainerCallback

    from xrlhf.envs import clean_response

    batch, mini, epochs = batch_shape(cfg)
    per_step = batch // mini * epochs  # TRL's optimizer steps per RL step (a batch generated)
    every, last = cfg.trainer.eval_every * per_step, cfg.trainer.steps * per_step

    class Evaluator(TrainerCallback):
        trainer = None

        def __init__(self):
            self.t0 = None
            self.eval_total = 0.0
            self.done: set[int] = set()
            self.f = open(path, "w")

        def evaluate(self, step: int) -> None:
            if step in self.done:
                return
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            ids = greedy_completions(self.trainer, prompt_ids, cfg.policy.generate.max_new_tokens, tokenizer)
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            rewards = [float(verify(clean_response(x), q.answer)) for x, q in zip(texts, prompts)]
            row = {"step": step // per_step, "eval_reward": sum(rewards) / len(rewards)}
            for task in sorted({q.task for q in prompts}):
                mine = [r for r, q in zip(rewards, prompts) if q.task == task]
                row[f"eval_reward_{task}"] = sum(mine) / len(mine)
            if cuda:
                torch.cuda.synchronize()
            spent = time.perf_counter() - t
            row.update(rl_s=round(t - self.t0 - self.eval_total, 3), eval_s=round(spent, 3), wall_time=time.time())
            self.eval_total += spent
            self.done.add(step)
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()
            print(f"[trl-eval] step {step}: eval reward {row['eval_reward']:.3f} at {row['rl_s']:.1f} s "
                  f"(eval {spent:.1f} s)", flush=True)

        def on_train_begin(self, args_, state, control, **kw):
            self.t0 = time.perf_counter()
            self.evaluate(0)

        def on_step_end(self, args_, state, control, **kw):
            if (every and state.global_step % every == 0) or state.global_step == last:
                self.evaluate(state.global_step)

        def on_train_end(self, args_, state, control, **kw):
            self.evaluate(state.global_step)
            self.f.close()

    return Evaluator()


def learn(argv: list[str] | None = None) -> int:
    args = learn_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    set_environment()
    import torch
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    cuda = torch.cuda.is_available() and not args.smoke
    cfg = recipe(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ds, eval_ids, eval_prompts, verify, verifier = workload_data(cfg, tokenizer)

    def reward(prompts, completions, answer, **kwargs):
        from xrlhf.envs import clean_response

        return [float(verify(clean_response(c), a)) for c, a in zip(completions, answer)]

    reward.__name__ = f"xrlhf_{verifier}"  # TRL names the reward metric after it
    events: list = []
    record_profiling(events)
    evaluator = eval_callback(cfg, eval_ids, eval_prompts, verify, tokenizer, out / "evals.jsonl", cuda)
    gcfg = learn_config(args, cfg, out, cuda)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=gcfg, train_dataset=ds,
                          callbacks=[step_timer(out, cuda, events), evaluator])
    evaluator.trainer = trainer
    t_init = time.perf_counter() - t0
    print(f"[trl] trainer + vLLM built in {t_init:.1f}s; generation_batch_size {gcfg.generation_batch_size}, "
          f"grad accumulation {gcfg.gradient_accumulation_steps}, policy dtype {trainer.model.dtype}", flush=True)
    t1 = time.perf_counter()
    trainer.train()
    summary = {"trl": trl.__version__, "torch": torch.__version__, "init_s": round(t_init, 2),
               "train_s": round(time.perf_counter() - t1, 2), "eval_s": round(evaluator.eval_total, 2),
               "model": args.model, "config": args.config, "overrides": args.set, "seed": cfg.seed,
               "steps": gcfg.max_steps, "generation_batch_size": gcfg.generation_batch_size,
               "num_generations": gcfg.num_generations, "micro_batch": gcfg.per_device_train_batch_size,
               "gradient_accumulation_steps": gcfg.gradient_accumulation_steps, "beta": gcfg.beta,
               "learning_rate": gcfg.learning_rate, "max_completion_length": gcfg.max_completion_length,
               "loss_type": gcfg.loss_type, "policy_dtype": str(trainer.model.dtype), "eval_prompts": len(eval_ids),
               "vllm_importance_sampling_mode": gcfg.vllm_importance_sampling_mode, "train_prompts": len(ds)}
    if cuda:
        summary.update(gpu_versions(torch))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[trl] done: train {summary['train_s']:.1f} s (eval {summary['eval_s']:.1f} s of it)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``learn ...``: the learning recipe; ``[w] ...``: W's step time (a bare option list is W's,
    as ``accelerate launch`` and ``benchmarks.w_vs_trl`` give it)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["learn"]:
        return learn(argv[1:])
    return w(argv[1:] if argv[:1] == ["w"] else argv)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # xrlhf and benchmarks importable when run as a script
    sys.exit(main())
