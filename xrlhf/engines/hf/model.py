"""``HFModel``: a Transformers model and the forward pass every role of the ``hf`` backend needs.

It loads a local HF-format directory with the right head and forwards a batch (layout in
``xrlhf.data.batch``) to per-token logprobs (and entropy), values, or sequence scores for the
response part. The DeepSpeed backend reuses it and only swaps the optimizer and parallelism.

Dropout is off unless the train section says ``dropout: true``: RL compares the policy with
itself (the PPO ratio, the KL to the sampler and to the reference), and dropout noise makes
that ratio differ from 1 where nothing changed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Literal

import torch
import torch.nn.functional as F
from loguru import logger
from pydantic import BaseModel, Field, field_validator

from xrlhf.data.batch import Batch, response_width
from xrlhf.engines import budget
from xrlhf.engines.base import EngineSpec, ForwardOutput
from xrlhf.engines.hf import attention
from xrlhf.engines.hf.attention import attention_of, unreported
from xrlhf.engines.hf.compiling import compile_layers, use_cache_dir
from xrlhf.engines.hf.packing import Packed, Padded, pack_rows, pad_rows
from xrlhf.engines.hf.probe import choose_path, probe_chunked
from xrlhf.internals.torch import import_compiler
from xrlhf.utils.tensors import chunked_head_columns, head_columns

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(spec: EngineSpec, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Load ``spec.model_path`` with the head ``spec.head`` on ``spec.device``, in ``dtype``
    (default: ``spec.options.dtype``).

    Transformers' own load report is replaced by one line in xrlhf's words: a value or score
    head that the checkpoint lacks is expected (a critic or reward model started from a language
    model) and said so; any other missing or unexpected weight is a warning.
    """
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)
    from transformers.utils import logging as hf_logging

    kwargs: dict[str, Any] = {"dtype": dtype or DTYPES[spec.options.dtype], "output_loading_info": True}
    auto = {"causal_lm": AutoModelForCausalLM, "value": AutoModelForTokenClassification,
            "score": AutoModelForSequenceClassification}[spec.head]
    if spec.head != "causal_lm":
        kwargs["num_labels"] = 1
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = auto.from_pretrained(spec.model_path, **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    _report_loading(model, spec, info)
    return model.to(spec.device)


def build_imports(spec: EngineSpec) -> None:
    """Import what building a Transformers engine of ``spec`` will (``Engine.fork_imports``):
    the auto classes, the model's own modeling module (its ``config.json`` names it), torch's
    compiler front end where the layers compile, PEFT where adapters train: a trainer's build then
    skips their imports."""
    import json
    from pathlib import Path

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if isinstance(spec.options, HFModelOptions) and spec.options.compiles(spec.device):
        import_compiler()
    if getattr(spec.options, "lora", None) is not None:
        import peft  # noqa: F401
    config = Path(spec.model_path) / "config.json"
    if config.is_file():
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(json.loads(config.read_text()).get("model_type"))
        if name and hasattr(transformers, name):  # the lazy attribute imports the modeling module
            getattr(transformers, name)


def _report_loading(model: torch.nn.Module, spec: EngineSpec, info: dict[str, Any]) -> None:
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    head = [k for k in missing if spec.head != "causal_lm" and k.split(".")[0] in ("score", "classifier")]
    if head:
        logger.info(f"new {spec.head} head ({', '.join(head)}) on a language model checkpoint: initialised "
                    f"randomly, as expected for a critic or a reward model")
    other = [k for k in missing if k not in head]
    if other or unexpected:
        logger.warning(f"{spec.model_path}: weights not in the checkpoint (initialised randomly): "
                       f"{', '.join(other) or 'none'}; weights of the checkpoint not used: {', '.join(unexpected) or 'none'}")


DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)
"""torch's dropout modules (each a ``p`` of its own)."""


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0: ``nn.Dropout`` modules and the float
    ``*dropout*`` attributes attention layers read (``attention_dropout`` of Llama, Qwen2,
    Mistral, Gemma2). The config is left as it is, so a saved model keeps its own. Returns how
    many were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, DROPOUTS):
            changed += module.p > 0
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                changed += value > 0
                setattr(module, name, 0.0)
    return changed


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of ``tokens`` under softmax(logits / temperature): ``[B, R, V], [B, R] -> [B, R]``."""
    logits = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.gather(F.log_softmax(logits, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


class HFModelOptions(BaseModel):
    """The options ``HFModel`` reads: the hf and deepspeed train and infer engines inherit them."""

    packing: Literal["auto", "varlen", "masked", "off"] = Field(
        "auto", description="micro-batches packed into one row without padding: auto (varlen attention where a "
        "probe at start-up passes, else padded), varlen, masked (transformers' block-diagonal mask: dense), off")
    logprob_chunk_tokens: int | None = Field(
        None, ge=0, description="logprobs and entropy from the last hidden states, this many tokens at a time (fp32 "
        "logits of one chunk at once); 0: the model's full logits at once. Default: 1024 on CPU; on a GPU the most "
        "tokens (1024-8192, a power of two) whose fp32 logits take ~1 GiB (engines.budget.logprob_chunk): 8192 for "
        "a vocabulary of 32k")

    compile: bool | None = Field(
        None, description="torch.compile each decoder layer (regional compilation, dynamic shapes): fuses the "
        "many small operations of a layer (norms, rotary, activations), which otherwise take half a small model's "
        "GPU time; the first train and infer call compile (once for all layers). Default: on for a GPU's "
        "full-weight training and inference (the gain: docs/training.md), off on CPU, with "
        "gradient_checkpointing, LoRA (not measured on a GPU yet) and DeepSpeed")

    def chunk_tokens(self, device: str, vocab: int) -> int:
        """Tokens per logprob chunk on ``device`` for a vocabulary of ``vocab``: the option where
        set, else ``engines.budget.logprob_chunk``."""
        if self.logprob_chunk_tokens is not None:
            return self.logprob_chunk_tokens
        return budget.logprob_chunk(vocab, "cuda" if device.startswith("cuda") else device)

    def compiles(self, device: str) -> bool:
        """Whether the layers are compiled on ``device``: ``compile`` where set, else the default above."""
        if self.compile is not None:
            return self.compile
        return (device.startswith("cuda") and not getattr(self, "gradient_checkpointing", False)
                and getattr(self, "lora", None) is None)

    @field_validator("packing", mode="before")
    @classmethod
    def _yaml_booleans(cls, v: Any) -> Any:
        """YAML reads an unquoted ``off`` (and ``no``, ``false``) as ``False``: that means off;
        ``True`` means auto."""
        return {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v


class HFModel:
    """A Transformers model and the forward pass every role needs.

    Attributes:
        module: the Transformers model (``model`` may be a wrapper that calls it: DeepSpeed).
        attention_path: how micro-batches are laid out: ``varlen`` / ``masked`` (packed into
            one row, ``engines.hf.packing``) or ``padded``; chosen by ``prepare``.
        logprob_chunk: tokens per chunk of the logprob head (``utils.tensors.chunked_token_logprobs``);
            0: the model's full logits.
    """

    def __init__(self, spec: EngineSpec, keep_dropout: bool = False, dtype: torch.dtype | None = None):
        """``keep_dropout``: a train engine's ``dropout`` option; frozen engines run in eval mode,
        where dropout is off anyway. ``dtype``: the weights load in it (default: the options'
        ``dtype``; a mixed-precision train engine loads fp32 to start its masters from exact
        values, then makes the weights bf16). Until ``prepare`` runs the forward is the padded one
        with full logits (an engine that never calls it keeps that)."""
        self.spec = spec
        torch.manual_seed(spec.seed)
        self.model = self.module = load_hf_model(spec, dtype)
        self.device = torch.device(spec.device)
        if not keep_dropout:
            disable_dropout(self.model)
        self.options = (spec.options if isinstance(spec.options, HFModelOptions)
                        else HFModelOptions(packing="off", compile=False))  # a generate engine: eager
        self.attention_path = "padded"
        self.logprob_chunk = 0
        self.head_compiled = False
        """Whether the logprob chunks go through ``torch.compile`` (``utils.tensors.compiled_chunk_columns``):
        set by ``prepare`` where the layers compile."""
        self.budgets: dict[bool, int] = {}
        """Token budgets derived for the GPU (``derived_budget``), by ``training``."""

    def prepare(self) -> str:
        """Choose the logprob head and the layout by probing the placed model (every rank of a
        ZeRO-3 group together); logged once and returned."""
        o = self.options
        head = "logprobs: full logits"
        vocab = int(getattr(self.module.config, "vocab_size", 0) or 0)  # 0 (not named): the CPU's chunk
        chunk = o.chunk_tokens(self.spec.device, vocab) if self.spec.head == "causal_lm" else 0
        if chunk:
            problem = probe_chunked(self, chunk)
            if problem is None:
                self.logprob_chunk = chunk
                head = f"logprobs: chunks of {chunk} tokens"
            else:
                head = f"logprobs: full logits ({problem})"
        self.attention_path, detail = choose_path(self, o.packing)
        line = f"{self.spec.model_path} ({self.spec.head}): {self.attention_path} micro-batches ({detail})"
        line += f"; {head}" if self.spec.head == "causal_lm" else ""
        if o.compiles(self.spec.device):
            cache = use_cache_dir(self.spec.cache_dir)
            line += f"; {compile_layers(self.module)}" + (f", cache {cache}" if cache else "")
            self.head_compiled = self.logprob_chunk > 0
            line += ", logprob chunks compiled" if self.head_compiled else ""
        logger.info(line)
        return line

    def derived_budget(self, training: bool, pending_bytes: int = 0, checkpointing: bool = False) -> int | None:
        """Tokens per micro-batch sized for this GPU's free memory (``engines.budget``), derived at
        the first call of each kind (``training``: forwards with a backward) and logged with its
        numbers; ``None`` off a GPU. ``pending_bytes``: what the engine will still allocate
        (optimizer states before the first step)."""
        if training in self.budgets:
            return self.budgets[training]
        if self.device.type != "cuda":
            return None
        shape = budget.Shape.of(self.module.config)
        dtype_bytes = next(self.module.parameters()).element_size()
        chunked = self.spec.head == "causal_lm" and self.logprob_chunk > 0
        full = self.spec.head == "causal_lm" and not chunked
        compiled = self.options.compiles(self.spec.device)
        per_token = (budget.train_bytes_per_token(shape, dtype_bytes, checkpointing, full, compiled) if training
                     else budget.infer_bytes_per_token(shape, dtype_bytes, full, compiled))
        fixed = budget.head_bytes(shape, self.logprob_chunk, training) if chunked else 0
        b = budget.derive(budget.free_bytes(self.device), pending_bytes, fixed, per_token, self.spec.memory_share,
                          infer=not training)
        logger.info(b.describe(f"{self.spec.model_path} ({self.spec.head}) {'train' if training else 'infer'}"))
        self.budgets[training] = b.tokens
        return self.budgets[training]

    def forward(self, batch: Batch, need_entropy: bool = False, gather: torch.Tensor | None = None) -> ForwardOutput:
        """Forward over ``batch`` (layout of ``xrlhf.data.batch``); response part only, ``[B, R]``
        (``scores``: ``[B]``), zero where no response token is. An attention kernel this process
        had not run before is logged (``attention.TAKEN``).

        ``gather`` ``[B, R, k]``: token ids whose logprobs each response position also returns
        (``ForwardOutput.gathered``, differentiable: a teacher's top-k ids in top-k distillation).
        With the options' ``topk_logprobs`` (an infer engine's), each position's most likely
        tokens and their logprobs come back too (``topk_logprobs``, ``topk_ids``)."""
        out = self._forward(batch, need_entropy, gather)
        for line in unreported():
            logger.info(f"{self.spec.model_path} ({self.spec.head}): attention ran {line}")
        return out

    def _forward(self, batch: Batch, need_entropy: bool, gather: torch.Tensor | None = None) -> ForwardOutput:
        ids, attn, r = batch["input_ids"], batch["attention_mask"], response_width(batch)
        layout = (pad_rows if self.attention_path == "padded" else pack_rows)(ids, attn, r)
        extra = None if gather is None else layout.from_rows(gather.to(ids.device))  # built on the host, as the layout
        layout = layout.to(self.device)
        if self.spec.head == "causal_lm":
            return self._logprobs(layout, need_entropy, extra if extra is None else extra.to(self.device))
        if self.spec.head == "value":
            out = self.model(**self._inputs(layout), use_cache=False)
            return ForwardOutput(values=layout.to_rows(out.logits[:, layout.keep, 0].float()))
        return ForwardOutput(scores=self._scores(layout))

    def _logprobs(self, layout: Packed | Padded, need_entropy: bool, extra: torch.Tensor | None = None
                  ) -> ForwardOutput:
        """``extra`` ``[b, n, k]``: more ids to gather at each predicted position (``forward``'s
        ``gather`` in the layout)."""
        temperature = max(self.spec.temperature, 1e-6)
        call = dict(self._inputs(layout), logits_to_keep=layout.keep, use_cache=False)
        targets = layout.targets.unsqueeze(-1)
        targets = targets if extra is None else torch.cat([targets, extra], -1)  # [b, n, 1 + k]
        topk = getattr(self.options, "topk_logprobs", 0)
        if self.logprob_chunk:
            with logprob_head(self.module.get_output_embeddings(), targets, temperature, self.logprob_chunk,
                              need_entropy, topk, self.head_compiled):
                out = self.model(**call).logits  # [b, n, C]: the head's columns (utils.tensors.chunked_head_columns)
        else:
            out = head_columns(self.model(**call).logits.float() / temperature, targets, need_entropy, topk)
        m = targets.shape[-1]
        col = m + int(need_entropy)
        return ForwardOutput(
            logprobs=layout.to_rows(out[..., 0]),
            entropy=layout.to_rows(out[..., m]) if need_entropy else None,
            gathered=layout.to_rows(out[..., 1:m]) if extra is not None else None,
            topk_logprobs=layout.to_rows(out[..., col:col + topk]) if topk else None,
            topk_ids=layout.to_rows(out[..., col + topk:]).round().long() if topk else None)

    def _inputs(self, layout: Packed | Padded) -> dict[str, Any]:
        """The model call's keyword arguments for ``layout``: a packed row under ``xrlhf_varlen``
        gets ``attention.no_mask``'s placeholder for its attention mask (no device sync per forward)."""
        inputs = layout.inputs
        if layout.packed and attention_of(self.module) == attention.NAME:
            inputs["attention_mask"] = attention.no_mask(inputs["input_ids"].device)
        return inputs

    def _scores(self, layout: Packed | Padded) -> torch.Tensor:
        if not layout.packed:
            return self.model(**self._inputs(layout), use_cache=False).logits[:, 0].float()
        seen: list[torch.Tensor] = []  # the score layer's per-token output, before the model pools it
        hook = self.module.score.register_forward_hook(lambda module, args, out: seen.append(out))
        try:
            self.model(**self._inputs(layout), use_cache=False)
        finally:
            hook.remove()
        return layout.last_token(seen[-1][..., 0].float())


@contextmanager
def logprob_head(lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float, chunk: int,
                 need_entropy: bool, topk: int = 0, compiled: bool = False) -> Iterator[None]:
    """Within the block, ``lm_head`` returns logprobs (and entropy, top-k) instead of logits.

    ``lm_head``'s forward becomes ``[b, n, H] -> [b, n, C]``: the fp32 logprobs of ``targets``
    ``[b, n]`` or ``[b, n, m]`` (and the entropy, the top-k logprobs and ids) computed chunk by
    chunk from the original forward (``utils.tensors.chunked_head_columns``). The model calls its head as it always
    does, so whatever wraps the head still runs around it: DeepSpeed ZeRO-3 gathers the
    weight once per forward and once per backward, on every rank alike, however many chunks a
    rank has. ``HFModel.prepare`` checks that the model returns the head's output unchanged.
    ``compiled``: each chunk through ``torch.compile`` (the engines whose layers compile).
    """
    original = lm_head.forward
    had_own = "forward" in vars(lm_head)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        cols = chunked_head_columns(hidden.flatten(0, 1), original, targets.reshape(-1, targets.shape[-1]),
                                    temperature, chunk, need_entropy, topk, compiled)
        return cols.view(*hidden.shape[:2], -1)

    lm_head.forward = forward
    try:
        yield
    finally:
        if had_own:
            lm_head.forward = original
        else:
            del lm_head.forward
