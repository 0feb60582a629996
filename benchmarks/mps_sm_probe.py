"""One train step and one logprob forward of W's policy under an MPS daemon's SM limit: are they
finite, and are W's GEMMs right? (2026-11-26e, one H100: cuBLAS's bf16 GEMMs are wrong, with no
error, under limits of 30, 40, 60, 70, 75 and 80%; right at 20, 50, 90, 95 and 100%. A right loss
proves nothing: at 70% W's loss was right while 18 of 30 GEMM shapes were not. docs/async.md.)

On the GPU machine, with a daemon of one's own (``CUDA_MPS_PIPE_DIRECTORY``)::

    CUDA_MPS_PIPE_DIRECTORY=$P nvidia-cuda-mps-control -d
    CUDA_MPS_PIPE_DIRECTORY=$P CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75 python -m benchmarks.mps_sm_probe --compile 0

``--bisect`` (eager layers) finds where: a forward hook on every module names the first one whose
output is not finite (with its inputs' finiteness and shapes; a ``Linear`` is recomputed in fp32
and again in bf16 to tell a GEMM's fault from its input's), and ``gemms`` first
checks W's GEMM shapes alone (bf16 against fp32, forward and both backward products) at a few
row counts.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import ensure_model
from benchmarks.train_efficiency import W, make_batch, precision_policy, w_loss


def _finite(x: object) -> bool | None:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return bool(torch.isfinite(x).all())
    if isinstance(x, (tuple, list)):
        flags = [f for f in map(_finite, x) if f is not None]
        return all(flags) if flags else None
    return None


def _shapes(x: object) -> list:
    if isinstance(x, torch.Tensor):
        return [tuple(x.shape)]
    if isinstance(x, (tuple, list)):
        return [s for v in x for s in _shapes(v)]
    return []


def first_non_finite(module: torch.nn.Module) -> tuple[list[str], object]:
    """Hooks on every submodule of ``module``: the list they fill with a line per module whose
    output is not finite (the first is the culprit's candidate), and the hooks' handles."""
    found: list[str] = []

    def hook(name: str):
        def run(mod: torch.nn.Module, args: tuple, out: object) -> None:
            if len(found) >= 8 or _finite(out) is not False:
                return
            line = f"{name} ({type(mod).__name__}): inputs finite {_finite(args)} {_shapes(args)} -> {_shapes(out)}"
            if isinstance(mod, torch.nn.Linear) and _finite(args):
                x = args[0]
                again = torch.nn.functional.linear(x, mod.weight, mod.bias)
                exact = torch.nn.functional.linear(x.float(), mod.weight.float(),
                                                   None if mod.bias is None else mod.bias.float())
                line += (f"; recomputed bf16 finite {bool(torch.isfinite(again).all())}, fp32 finite "
                         f"{bool(torch.isfinite(exact).all())}, M K N = {x.numel() // x.shape[-1]} {x.shape[-1]} "
                         f"{mod.weight.shape[0]}")
            found.append(line)
        return run

    handles = [m.register_forward_hook(hook(n)) for n, m in module.named_modules()]
    return found, handles


def gemms(hidden: int, inter: int, kv: int, vocab: int) -> None:
    """W's GEMM shapes alone at several row counts: bf16 results finite and near fp32's?"""
    torch.manual_seed(0)
    for m in (1024, 4096, 9216, 16384, 36000, 40037):
        for k, n in ((hidden, hidden), (hidden, kv), (hidden, inter), (inter, hidden), (hidden, vocab)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            bad = []
            for what, a, b in (("fwd", x, w.t()), ("dgrad", g, w), ("wgrad", g.t(), x)):
                y, ref = a @ b, a.float() @ b.float()
                err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                if not torch.isfinite(y).all() or err > 0.05:
                    bad.append(f"{what} finite {bool(torch.isfinite(y).all())} rel err {err:.3g}")
            print(f"gemm M {m} K {k} N {n}: {'; '.join(bad) or 'ok'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", type=int, default=0, help="1: compiled layers")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--bisect", action="store_true", help="name the first module whose output is not finite")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], help="torch.backends.cuda.preferred_blas_library")
    ap.add_argument("--carveout", type=int, default=0,
                    help="SMs left free of the GEMMs (HFModelOptions.sm_carveout: cuBLASLt's SM count target)")
    args = ap.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.carveout:
        from xrlhf.engines.hf.model import carve_out_sms

        carve_out_sms(args.carveout / torch.cuda.get_device_properties(0).multi_processor_count, torch.device("cuda"))
    from transformers import AutoConfig

    model = ensure_model()
    batch = make_batch(W, AutoConfig.from_pretrained(model).vocab_size)
    policy = precision_policy(model, "cuda", "mixed", compile=bool(args.compile))
    inputs = batch.select("input_ids", "attention_mask", "response_mask")
    print("SMs", torch.cuda.get_device_properties(0).multi_processor_count, flush=True)
    if args.bisect:
        cfg = policy.hf.module.config
        gemms(cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads,
              cfg.vocab_size)
        found, handles = first_non_finite(policy.hf.module)
    for i in range(args.steps):
        metrics = policy.train_step(batch, w_loss())
        logprobs = policy.infer(inputs)["logprobs"]
        print(f"compile={bool(args.compile)} step {i}: loss {metrics['loss']:.5f} finite logprobs "
              f"{bool(torch.isfinite(logprobs).all())}", flush=True)
        if args.bisect:
            print("\n".join(found) or "every module's output finite", flush=True)
            found.clear()


if __name__ == "__main__":
    main()
