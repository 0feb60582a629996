"""Train-step time and peak GPU memory of the DeepSpeed engine: ZeRO-2, ZeRO-3, ZeRO-3 + offload.

Builds a model locally (``xrlhf.models.tiny.PRESETS``, no hub access), then for each setting
spawns one process per GPU (no launcher: ``torch.multiprocessing`` and a TCP rendezvous),
builds ``DeepSpeedTrainEngine`` exactly as a run does, and times ``train_step`` on a fixed
synthetic batch with the SFT loss. Memory is ``torch.cuda.max_memory_allocated`` on rank 0
over the timed steps (model, gradients, optimizer shards and activations), plus what the
engine held after set-up.

    python -m benchmarks.train_step deepspeed --out benchmarks/results/deepspeed.json # 2 GPUs, 1.5b
    python -m benchmarks.train_step deepspeed --device cpu --preset tiny --out /tmp/ds.json  # logic check

The first offload run JIT-compiles DeepSpeed's CPU Adam (about a minute, then cached).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import tempfile
import time
from pathlib import Path

import torch

SETTINGS = {
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3),
    "zero3_offload": dict(zero_stage=3, offload_optimizer=True, offload_params=True),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(rows: int, prompt: int, response: int, vocab: int, seed: int):
    from xrlhf.data.batch import build_sequences

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, vocab, (rows, prompt), generator=g).tolist()
    responses = torch.randint(4, vocab, (rows, response), generator=g).tolist()
    return build_sequences(prompts, responses, pad_id=0)


def _rank(rank: int, world: int, port: int, args: dict, setting: str, result_path: str) -> None:
    from xrlhf.algorithms.losses import SFTLoss
    from xrlhf.engines.base import DistInfo, EngineSpec
    from xrlhf.engines.deepspeed import DeepSpeedTrainEngine

    cuda = args["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    device = f"cuda:{rank}" if cuda else "cpu"
    options = {"lr": 1e-5, "micro_batch_size": args["micro_batch_size"], "grad_clip": 1.0,
               "dtype": "bfloat16" if cuda else "float32", "gradient_checkpointing": args["gradient_checkpointing"],
               **SETTINGS[setting]}
    spec = EngineSpec(model_path=args["model_dir"], device=device, options=options,
                      dist=DistInfo(rank, world, "127.0.0.1", port, "nccl" if cuda else "gloo"), seed=0)
    t0 = time.time()
    engine = DeepSpeedTrainEngine(spec)
    setup_s = time.time() - t0
    vocab = engine.zero.module.config.vocab_size
    batch = _batch(args["rows_per_rank"], args["prompt_len"], args["response_len"], vocab, seed=rank)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    after_setup = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(args["warmup_steps"] + args["steps"]):
        sync()
        t = time.perf_counter()
        m = engine.train_step(batch, SFTLoss())
        sync()
        if step >= args["warmup_steps"]:
            times.append(time.perf_counter() - t)
        losses.append(m["loss"])
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    if rank == 0:
        tokens = args["rows_per_rank"] * world * (args["prompt_len"] + args["response_len"])
        mean = sum(times) / len(times)
        Path(result_path).write_text(json.dumps({
            "setting": setting, **SETTINGS[setting], "step_time_s_mean": round(mean, 4),
            "step_time_s_min": round(min(times), 4), "tokens_per_s": round(tokens / mean, 1),
            "peak_gpu_mem_gib": round(peak / 2**30, 3), "gpu_mem_after_setup_gib": round(after_setup / 2**30, 3),
            "setup_s": round(setup_s, 1), "losses": [round(x, 4) for x in losses]}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def build(args) -> str:
    """The benchmark model (built once, reused from ``--model-dir`` if it is there)."""
    from xrlhf.models.tiny import PRESETS, build_model

    d = Path(args.model_dir or Path(tempfile.gettempdir()) / f"xrlhf-bench-{args.preset}")
    if not (d / "config.json").is_file():
        t0 = time.time()
        build_model(d, **PRESETS[args.preset], dtype="bfloat16" if args.device == "cuda" else "float32")
        print(f"built {args.preset} in {time.time() - t0:.0f}s at {d}", flush=True)
    return str(d)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_step deepspeed", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--preset", default="1.5b", help="a xrlhf.models.tiny.PRESETS name")
    p.add_argument("--model-dir", default=None, help="where the model is built (default: a temp dir)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--rows-per-rank", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        p.error(f"--ranks {args.ranks} needs that many GPUs; {torch.cuda.device_count()} visible")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    model_dir = build(args)
    params = _count_params(model_dir)
    results = []
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "settings")}
    cfg["model_dir"] = model_dir
    for setting in args.settings.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        t0 = time.time()
        torch.multiprocessing.spawn(_rank, args=(args.ranks, _free_port(), cfg, setting, path), nprocs=args.ranks)
        r = json.loads(Path(path).read_text())
        r["wall_s"] = round(time.time() - t0, 1)
        results.append(r)
        print(json.dumps(r), flush=True)
    import deepspeed

    out = {"benchmark": "deepspeed train_step (SFT loss) on a locally built model",
           "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
           "gpus": args.ranks if args.device == "cuda" else 0, "ranks": args.ranks, "preset": args.preset,
           "params": params, "dtype": "bfloat16" if args.device == "cuda" else "float32",
           "global_batch": {"rows": args.rows_per_rank * args.ranks, "micro_batch_size": args.micro_batch_size,
                            "prompt_len": args.prompt_len, "response_len": args.response_len},
           "gradient_checkpointing": args.gradient_checkpointing,
           "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                        "cuda": torch.version.cuda},
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _count_params(model_dir: str) -> int:
    from safetensors import safe_open

    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n += _prod(st.get_slice(k).get_shape())
    return n


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
