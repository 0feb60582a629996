"""The memory of one engine on one GPU, by part: pure functions of a shape and the options.

Bytes per parameter (``P`` the model's, ``T`` the trained ones: ``P`` or a LoRA adapter's):

================  =====================================================================
hf, fp32          weights 4P, gradients 4T, AdamW 8T
hf, pure bf16     weights 2P, gradients 2T, AdamW 4T (states in the weights' dtype)
hf, mixed         weights 2P, fp32 masters 4T, fp32 gradients 4T, AdamW 8T
                  (``engines.mixed_precision``: bf16 gradients are freed as they are added)
LoRA (any)        the frozen base in its dtype; adapters fp32: 4T + 4T + 8T (PEFT keeps them fp32)
deepspeed, bf16   weights 2P, bf16 gradients 2T, fp32 masters 4T and AdamW 8T; ZeRO-1 divides
                  masters and AdamW by the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights
                  too; the fp32 gradient of a partition exists only inside the optimizer step
                  (after the activations are freed), so it is not counted in the peak
================  =====================================================================

DeepSpeed's buffers at its defaults: ZeRO-2 a gradient bucket of ``reduce_bucket_size`` (5e8
elements), ZeRO-3 that bucket plus up to ``stage3_max_live_parameters`` (1e9) gathered weights.
Offloaded optimizer states (and ZeRO-3 offloaded weights) leave the GPU.

Activations per token: ``engines.budget`` (the same functions the engines size their derived
token budgets with, so a plan and a run agree), times the tokens of the largest micro-batch.
Calibration and checks against measured GPU figures: tests/plan/test_measured.py, docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from xrlhf.engines import budget
from xrlhf.plan.backends import backend, paged
from xrlhf.plan.shapes import ModelShape

GIB = 2**30
DS_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's ``reduce_bucket_size`` default (elements)."""
DS_MAX_LIVE = 1_000_000_000
"""DeepSpeed's ``stage3_max_live_parameters`` default (elements)."""
CUDA_CONTEXT = int(0.86 * GIB)
"""A process's CUDA context, the kernels it loaded and what its allocator holds beyond its
allocations, measured on the distillation run of ``configs/gpu/distill_vllm.yaml`` (docs/plan.md)."""
CUBLAS_WORKSPACE = 64 * 2**20
"""torch's cuBLAS and cuBLASLt workspaces in a process that multiplied matrices on the GPU: 2 x
32 MiB on Hopper (``CUBLAS_WORKSPACE_CONFIG``'s default there, ``:4096:8``). torch's caching
allocator holds them, so they count in a handle's allocations (measured: docs/plan.md)."""
VLLM_GRAPHS_FLOOR = int(0.09 * GIB)
"""vLLM's CUDA graphs of a model with next to no activations (the distillation student, 2 layers
of 64, up to 256 sequences; from vLLM's log: docs/plan.md)."""
VLLM_GRAPHS_W = int(0.20 * GIB)
"""The same for a 0.5B model (24 layers of 1,024, up to 512 sequences) with whole decode steps
captured, xrlhf's default (``torch_compile: false``); vLLM's torch.compile, which captures
piecewise graphs too, about doubles it (docs/plan.md)."""
VLLM_BATCHED_TOKENS = 16384
"""vLLM's default ``max_num_batched_tokens`` for ``LLM`` on a large data-centre GPU (vLLM picks
it by the device): its profile run's tokens."""


@dataclass(frozen=True)
class Trainer:
    """A trained handle's engine as the memory model sees it.

    Attributes:
        engine: the train backend (a name or an import path); its class's ``memory_model`` says
            which rows of the module's table count (``zero``: DeepSpeed's).
        precision: ``fp32``, ``bf16`` (pure) or ``mixed`` (bf16 weights, fp32 masters).
        trainable: trained parameters (``None``: all; a LoRA adapter's otherwise).
        ranks: data-parallel ranks (ZeRO divides by these).
        tokens: tokens of the largest micro-batch with gradients (``None``: derived for the GPU).
        infer_tokens: tokens of its largest forward without gradients (``None``: derived).
        chunk: the chunked logprob head's tokens (0: full logits, or no LM head).
    """

    head: str = "causal_lm"
    engine: str = "hf"
    precision: str = "mixed"
    trainable: int | None = None
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    ranks: int = 1
    tokens: int | None = None
    infer_tokens: int | None = None
    checkpointing: bool = False
    chunk: int = 1024
    rows: int = 0
    """Rows per micro-batch when a token budget is set (0: rows not capped, as with a derived budget)."""
    compiled: bool = False
    """Its decoder layers compiled (fewer activations kept: ``engines.budget``)."""


def act_shape(shape: ModelShape) -> budget.Shape:
    """The activation estimate's view of a shape."""
    return budget.Shape(shape.hidden, shape.layers, shape.intermediate, shape.kv_width, shape.vocab)


def compute_bytes(t: Trainer) -> int:
    """Bytes of one weight in the forward: 4 in fp32, 2 otherwise."""
    return 4 if t.precision == "fp32" else 2


def trainer_state(shape: ModelShape, t: Trainer, stepped: bool = True) -> dict[str, int]:
    """What a trained handle holds on each GPU between micro-batches, by part (bytes).

    ``stepped``: after its first optimizer step (AdamW's states exist); before it they are
    still to come (the derived budget counts them as pending)."""
    p = shape.head_params(t.head)
    lora = t.trainable is not None
    n = t.trainable if lora else p
    w = compute_bytes(t)
    if lora:
        parts = {"weights": p * w, "adapters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}
    elif backend(t.engine, "train").memory_model == "zero":
        parts = _deepspeed(p, w, t)
    elif t.precision == "mixed":
        parts = {"weights": 2 * p, "masters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}
    else:
        parts = {"weights": w * p, "gradients": w * n, "optimizer": 2 * w * n}
    if not stepped:
        parts["optimizer"] = 0
    return {k: int(v) for k, v in parts.items() if v}


def _deepspeed(p: int, w: int, t: Trainer) -> dict[str, float]:
    """DeepSpeed ZeRO's resident parts per rank (see the module's table)."""
    r, s = t.ranks, t.zero_stage
    master = 4 * p if w == 2 else 0  # bf16 keeps fp32 masters; fp32 weights are their own masters
    opt = 8 * p / (r if s >= 1 else 1)
    masters = master / (r if s >= 1 else 1)
    if t.offload_optimizer and s >= 1:
        opt = masters = 0
    grads = w * p / (r if s >= 2 else 1)
    weights = 0 if t.offload_params else w * p / (r if s >= 3 else 1)
    buffers = w * min(p, DS_REDUCE_BUCKET) if s >= 2 else 0
    if s >= 3:
        buffers += w * min(p, DS_MAX_LIVE)
        grads = 0 if t.offload_optimizer else grads
    return {"weights": weights, "masters": masters, "gradients": grads, "optimizer": opt, "zero buffers": buffers}


def train_bytes_per_token(shape: ModelShape, t: Trainer) -> int:
    """Activation bytes a micro-batch keeps per token until its backward (``engines.budget``): also
    the figure the engine derives its budget with."""
    full = t.head == "causal_lm" and not t.chunk
    return budget.train_bytes_per_token(act_shape(shape), compute_bytes(t), t.checkpointing, full, compiled=t.compiled)


def infer_bytes_per_token(shape: ModelShape, t: Trainer | None, dtype_bytes: int = 2, head: str = "causal_lm",
                          chunk: int = 1024, compiled: bool = False) -> int:
    """Bytes a forward without gradients holds per token at its peak (``engines.budget``)."""
    if t is not None:
        dtype_bytes, head, chunk, compiled = compute_bytes(t), t.head, t.chunk, t.compiled
    return budget.infer_bytes_per_token(act_shape(shape), dtype_bytes, head == "causal_lm" and not chunk, compiled)


def head_working(shape: ModelShape, head: str, chunk: int, training: bool) -> int:
    """The chunked logprob head's fixed working memory (0 without one)."""
    return budget.head_bytes(act_shape(shape), chunk, training) if head == "causal_lm" and chunk else 0


def derived_tokens(free: int, pending: int, fixed: int, per_token: int, share: float, infer: bool) -> int:
    """The token budget an engine derives from ``free`` bytes (``engines.budget.derive``)."""
    return budget.derive(max(free, 0), pending, fixed, per_token, share, infer).tokens


@dataclass(frozen=True)
class Generator:
    """vLLM (or the Transformers generator) as the memory model sees it.

    Attributes:
        kv_tokens: ``kv_cache_tokens`` resolved to a number (``None``: vLLM fills
            ``gpu_memory_utilization`` of the GPU's total memory).
        batch_tokens: the tokens the step's sequences need in the KV cache at once.
    """

    engine: str = "vllm"
    dtype_bytes: int = 2
    tp: int = 1
    gpu_memory_utilization: float = 0.4
    kv_tokens: int | None = None
    max_num_seqs: int = 256
    batched_tokens: int = VLLM_BATCHED_TOKENS
    enforce_eager: bool = False
    torch_compile: bool = False
    sleep_level: int = 1
    batch_tokens: int = 0
    lora_bytes: int = 0


def vllm_parts(shape: ModelShape, g: Generator, gpu_bytes: int) -> dict[str, int]:
    """vLLM's memory on each of its GPUs awake, by part (bytes): weights, its profile run's
    activations (``max_num_batched_tokens`` through one layer's working set, plus the sampler's
    fp32 logits of ``max_num_seqs`` rows), CUDA graphs, and the KV cache: ``kv_tokens`` (plus a
    block per sequence, as ``engines.vllm.options.kv_cache_bytes`` asks for) or what is left of
    ``gpu_memory_utilization x total`` (vLLM's own arithmetic)."""
    weights = shape.params * g.dtype_bytes // g.tp + g.lora_bytes
    if not paged(g):  # the Transformers generator: weights and a cache of the batch
        kv = shape.kv_bytes_per_token(g.dtype_bytes) * g.batch_tokens
        return {"weights": weights, "kv cache": kv, "activations": g.max_num_seqs * shape.vocab * 4}
    # vLLM's own forward (fused QKV and gate-up projections), not ours: the working set it was
    # checked with (two models' allocations within 7%: docs/plan.md)
    per_token = (6 * shape.hidden + 2 * shape.kv_width + 4 * shape.intermediate) * g.dtype_bytes // g.tp
    act = g.batched_tokens * per_token + 2 * g.max_num_seqs * shape.vocab * 4
    graphs = vllm_graphs(shape, g)
    if g.kv_tokens is not None:
        kv = shape.kv_bytes_per_token(g.dtype_bytes) // g.tp * (g.kv_tokens + 16 * g.max_num_seqs)
    else:
        kv = max(0, int(g.gpu_memory_utilization * gpu_bytes) - weights - act)
    return {"weights": weights, "activations": act, "graphs": graphs, "kv cache": kv}


def vllm_graphs(shape: ModelShape, g: Generator) -> int:
    """vLLM's CUDA graphs (bytes): modelled from two measurements (``VLLM_GRAPHS_FLOOR``,
    ``VLLM_GRAPHS_W``) as a floor plus a part that grows with layers x hidden; twice that with
    vLLM's torch.compile; none with ``enforce_eager``."""
    if g.enforce_eager:
        return 0
    scale = shape.layers * shape.hidden / (24 * 1024)
    graphs = VLLM_GRAPHS_FLOOR + (VLLM_GRAPHS_W - VLLM_GRAPHS_FLOOR) * scale
    return int(graphs * (2 if g.torch_compile else 1))


def vllm_asleep(parts: dict[str, int], level: int) -> dict[str, int]:
    """What vLLM keeps on the GPU asleep: level 0 everything; 1 and 2 free the KV cache and
    the weights (to CPU memory, or dropped); graphs and the activation pool stay."""
    if level == 0:
        return dict(parts)
    return {k: v for k, v in parts.items() if k not in ("weights", "kv cache")}


def kv_tokens_held(shape: ModelShape, g: Generator, parts: dict[str, int]) -> int:
    """How many tokens vLLM's KV cache holds (to compare with the batch's)."""
    per = shape.kv_bytes_per_token(g.dtype_bytes) // g.tp
    return parts.get("kv cache", 0) // max(per, 1)
