"""Transformers backend: train, infer and generate engines on CPU or one GPU.

All three share ``HFModel``: loading a local HF-format directory with the right head, and a
forward pass that returns per-token logprobs (and entropy), values, or sequence scores for
the response part of a batch (layout in ``xrlhf.data.batch``). The DeepSpeed backend reuses
it and only swaps the optimizer/parallelism. The train step's loop is ``TrainEngine``'s
template; this backend gives it ``backward`` and ``optimizer_step``.

Dropout is off unless the train section says ``dropout: true``: RL compares the policy with
itself (the PPO ratio, the KL to the sampler and to the reference), and dropout noise makes
that ratio differ from 1 where nothing changed.

The generate engine samples with ``model.generate`` on torch's global RNG, or, given a seed per
prompt, with the keyed decode loop of ``hf_decode`` (a generator per row; weights may change
between two tokens of a running call).
"""

from __future__ import annotations

import dataclasses
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal

import torch
import torch.nn.functional as F

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from xrlhf.config.schema import yaml_path
from xrlhf.data.batch import Batch, response_width
from xrlhf.engines.base import (ENGINES, EngineSpec, ForwardOutput, GenerateEngine, GenerateOptions, GenerationOutput,
                                InferEngine, InferOptions, NamedTensors, SamplingParams, TrainEngine, TrainOptions)
from xrlhf.engines.hf_decode import StepHook, WeightGate, decode_keyed
from xrlhf.engines.lora import LoraModel, LoraTraining, LoraTrainOptions, apply_lora
from xrlhf.engines.packing import Packed, Padded, pack_rows, pad_rows
from xrlhf.engines.training import all_reduce_grads, lr_lambda
from xrlhf.utils.tensors import chunked_token_logprobs, entropy_from_logits

if TYPE_CHECKING:
    from xrlhf.weight_sync import Message, Transport

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


def _report_loading(model: torch.nn.Module, spec: EngineSpec, info: dict[str, Any]) -> None:
    from loguru import logger

    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    head = [k for k in missing if spec.head != "causal_lm" and k.split(".")[0] in ("score", "classifier")]
    if head:
        logger.info(f"new {spec.head} head ({', '.join(head)}) on a language model checkpoint: initialised "
                    f"randomly, as expected for a critic or a reward model")
    other = [k for k in missing if k not in head]
    if other or unexpected:
        logger.warning(f"{spec.model_path}: weights not in the checkpoint (initialised randomly): "
                       f"{', '.join(other) or 'none'}; weights of the checkpoint not used: {', '.join(unexpected) or 'none'}")


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0: ``nn.Dropout`` modules and the float
    ``*dropout*`` attributes attention layers read (``attention_dropout`` of Llama, Qwen2,
    Mistral, Gemma2). The config is left as it is, so a saved model keeps its own. Returns how
    many were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
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
    logprob_chunk_tokens: int = Field(1024, ge=0, description="logprobs and entropy from the last hidden states, "
                                      "this many tokens at a time (fp32 logits of one chunk at once); 0: the "
                                      "model's full logits at once")

    compile: bool = Field(False, description="torch.compile each decoder layer (regional compilation, dynamic "
                          "shapes): fuses the many small operations of a layer, which bound a small model's step "
                          "on a GPU by the host; the first train and infer call compile (once for all layers)")

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
            one row, ``engines.packing``) or ``padded``; chosen by ``prepare``.
        logprob_chunk: tokens per chunk of the logprob head (``utils.tensors.chunked_token_logprobs``);
            0: the model's full logits.
    """

    def __init__(self, spec: EngineSpec, keep_dropout: bool = False, autocast: torch.dtype | None = None,
                 fp32_weights: bool = True):
        """``keep_dropout``: a train engine's ``dropout`` option; frozen engines run in eval mode,
        where dropout is off anyway. ``autocast``: mixed precision: the forward runs under
        autocast to this dtype (``HFTrainOptions.mixed_precision``) and, with ``fp32_weights``,
        the weights load in fp32 (a LoRA engine keeps its frozen base in ``dtype``: PEFT makes the
        trained adapters fp32). Until ``prepare`` runs the forward is the padded one with full
        logits (an engine that never calls it keeps that)."""
        self.spec = spec
        self.autocast = autocast
        torch.manual_seed(spec.seed)
        fp32 = autocast is not None and fp32_weights
        self.model = self.module = load_hf_model(spec, torch.float32 if fp32 else None)
        self.device = torch.device(spec.device)
        if not keep_dropout:
            disable_dropout(self.model)
        self.options = spec.options if isinstance(spec.options, HFModelOptions) else HFModelOptions(packing="off")
        self.attention_path = "padded"
        self.logprob_chunk = 0

    def prepare(self) -> str:
        """Choose the logprob head and the layout by probing the placed model (every rank of a
        ZeRO-3 group together); logged once and returned."""
        from loguru import logger

        from xrlhf.engines.attention import choose_path, probe_chunked
        from xrlhf.engines.compiling import compile_layers

        o = self.options
        head = "logprobs: full logits"
        if self.spec.head == "causal_lm" and o.logprob_chunk_tokens:
            problem = probe_chunked(self, o.logprob_chunk_tokens)
            if problem is None:
                self.logprob_chunk = o.logprob_chunk_tokens
                head = f"logprobs: chunks of {self.logprob_chunk} tokens"
            else:
                head = f"logprobs: full logits ({problem})"
        self.attention_path, detail = choose_path(self, o.packing)
        line = f"{self.spec.model_path} ({self.spec.head}): {self.attention_path} micro-batches ({detail})"
        line += f"; {head}" if self.spec.head == "causal_lm" else ""
        line += f"; {compile_layers(self.module)}" if o.compile else ""
        line += "; fp32 master weights, bf16 autocast (mixed_precision)" if self.autocast is not None else ""
        logger.info(line)
        return line

    def forward(self, batch: Batch, need_entropy: bool = False) -> ForwardOutput:
        """Forward over ``batch`` (layout of ``xrlhf.data.batch``); response part only, ``[B, R]``
        (``scores``: ``[B]``), zero where no response token is; under autocast with mixed
        precision (the backward then runs outside it, as autocast wants)."""
        if self.autocast is None:
            return self._forward(batch, need_entropy)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return self._forward(batch, need_entropy)

    def _forward(self, batch: Batch, need_entropy: bool) -> ForwardOutput:
        ids, attn, r = batch["input_ids"], batch["attention_mask"], response_width(batch)
        layout = (pad_rows if self.attention_path == "padded" else pack_rows)(ids, attn, r).to(self.device)
        if self.spec.head == "causal_lm":
            return self._logprobs(layout, need_entropy)
        if self.spec.head == "value":
            out = self.model(**layout.inputs, use_cache=False)
            return ForwardOutput(values=layout.to_rows(out.logits[:, layout.keep, 0].float()))
        return ForwardOutput(scores=self._scores(layout))

    def _logprobs(self, layout: Packed | Padded, need_entropy: bool) -> ForwardOutput:
        temperature = max(self.spec.temperature, 1e-6)
        call = dict(layout.inputs, logits_to_keep=layout.keep, use_cache=False)
        if self.logprob_chunk:
            with logprob_head(self.module.get_output_embeddings(), layout.targets, temperature, self.logprob_chunk,
                              need_entropy):
                out = self.model(**call).logits  # [b, n, 1 or 2]: what the head returned
            lp, ent = out[..., 0], (out[..., 1] if need_entropy else None)
        else:
            logits = self.model(**call).logits.float() / temperature
            lp = torch.gather(F.log_softmax(logits, -1), -1, layout.targets.unsqueeze(-1)).squeeze(-1)
            ent = entropy_from_logits(logits) if need_entropy else None
        return ForwardOutput(logprobs=layout.to_rows(lp), entropy=None if ent is None else layout.to_rows(ent))

    def _scores(self, layout: Packed | Padded) -> torch.Tensor:
        if not layout.packed:
            return self.model(**layout.inputs, use_cache=False).logits[:, 0].float()
        seen: list[torch.Tensor] = []  # the score layer's per-token output, before the model pools it
        hook = self.module.score.register_forward_hook(lambda module, args, out: seen.append(out))
        try:
            self.model(**layout.inputs, use_cache=False)
        finally:
            hook.remove()
        return layout.last_token(seen[-1][..., 0].float())


@contextmanager
def logprob_head(lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float, chunk: int,
                 need_entropy: bool) -> Iterator[None]:
    """Within the block, ``lm_head`` returns logprobs (and entropy) instead of logits.

    ``lm_head``'s forward becomes ``[b, n, H] -> [b, n, 1 or 2]``: the fp32 logprob of
    ``targets`` ``[b, n]`` (and the entropy) computed chunk by chunk from the original
    forward (``utils.tensors.chunked_token_logprobs``). The model calls its head as it always
    does, so whatever wraps the head still runs around it: DeepSpeed ZeRO-3 gathers the
    weight once per forward and once per backward, on every rank alike, however many chunks a
    rank has. ``HFModel.prepare`` checks that the model returns the head's output unchanged.
    """
    original = lm_head.forward
    had_own = "forward" in vars(lm_head)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        lp, ent = chunked_token_logprobs(hidden.flatten(0, 1), original, targets.reshape(-1), temperature, chunk,
                                         need_entropy)
        return (lp.unsqueeze(-1) if ent is None else torch.stack((lp, ent), -1)).view(*hidden.shape[:2], -1)

    lm_head.forward = forward
    try:
        yield
    finally:
        if had_own:
            lm_head.forward = original
        else:
            del lm_head.forward


class HFTrainOptions(LoraTrainOptions, HFModelOptions):
    """``<handle>.train`` of the Transformers and DeepSpeed train engines: the shared train
    fields plus ``HFModelOptions``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mixed_precision: bool | None = Field(
        None, description="with dtype bfloat16: fp32 master weights, gradients and AdamW states, the forward in "
        "bf16 under autocast (true), or bf16 weights and optimizer states (false: half the memory of the states, "
        "updates below bf16's precision round away); default: true on a GPU, false on CPU (DeepSpeed's bf16 mode "
        "always keeps fp32 masters)")

    @model_validator(mode="after")
    def _compile_without_checkpointing(self, info: ValidationInfo):
        if self.compile and self.gradient_checkpointing:
            raise ValueError(f"{yaml_path(info, 'train')}.compile: the layers of gradient_checkpointing run eagerly "
                             f"in training (torch.compile does not trace through transformers' checkpointing); set "
                             f"one of compile, gradient_checkpointing to false")
        return self

    def uses_mixed_precision(self, device: str) -> bool:
        """Whether the engine trains fp32 masters under bf16 autocast on ``device``."""
        if self.dtype != "bfloat16":
            return False
        return self.mixed_precision if self.mixed_precision is not None else device.startswith("cuda")


class HFInferOptions(InferOptions, HFModelOptions):
    """``<handle>.infer`` of the Transformers and DeepSpeed infer engines."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@ENGINES.register("hf.infer")
class HFInferEngine(InferEngine):
    """Logprobs, values or scores with a frozen Transformers model."""

    Options = HFInferOptions

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        self.hf = HFModel(self.spec)
        self.hf.model.eval().requires_grad_(False)
        self.device = self.hf.device
        self.hf.prepare()

    @property
    def packed(self) -> bool:
        return self.hf.attention_path != "padded"

    def forward(self, batch: Batch, need_entropy: bool = False) -> ForwardOutput:
        return self.hf.forward(batch, need_entropy)


@ENGINES.register("hf.train")
class HFTrainEngine(LoraTraining, TrainEngine):
    """Plain PyTorch training of a Transformers model (AdamW); data parallel through
    torch.distributed (gradients summed in one flat all-reduce per dtype). With ``lora`` set,
    PEFT adapters train and the base stays frozen (``xrlhf.engines.lora``)."""

    Options = HFTrainOptions

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        spec.dist.init_process_group()
        o = self.options
        self.mixed_precision = o.uses_mixed_precision(spec.device)
        lora = self.adapter_options(o)
        self.hf = HFModel(self.spec, keep_dropout=o.dropout, autocast=torch.bfloat16 if self.mixed_precision else None,
                          fp32_weights=lora is None)
        self.lora: LoraModel | None = None
        if lora is not None:
            self.hf.model = apply_lora(self.hf.model, lora, o.gradient_checkpointing)
            self.lora = LoraModel(self.hf.model, lora)
        self.model = self.hf.model
        self.device = self.hf.device
        if o.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.lr_warmup_steps, spec.total_steps, o.lr_schedule))
        self._broadcast_initial_weights()
        self.hf.prepare()

    @property
    def packed(self) -> bool:
        return self.hf.attention_path != "padded"

    def _broadcast_initial_weights(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for t in self.model.state_dict().values():
                dist.broadcast(t, src=0)

    def forward(self, batch: Batch, need_entropy: bool = False) -> ForwardOutput:
        return self.hf.forward(batch, need_entropy)

    def infer(self, batch: Batch) -> Batch:
        self.model.eval()
        try:
            return super().infer(batch)
        finally:
            self.model.train()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def optimizer_step(self) -> dict[str, float]:
        all_reduce_grads(self.params)
        clip = self.options.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip else float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        if torch.isfinite(norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "lr": lr, "skipped": float(not torch.isfinite(norm))}

    def _state_items(self, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
        return ((k, v) for k, v in self.model.state_dict().items() if keep is None or keep(k))

    def _save_full(self, path: str) -> None:
        if self.spec.dist.rank == 0:  # every rank is called (sharded engines gather); rank 0 writes
            save_with_tokenizer(self.model, self.spec.model_path, path)

    def state_dict(self) -> dict[str, Any]:
        """Model (with LoRA: the trainable tensors only), optimizer and scheduler state."""
        model = self.model.state_dict()
        if self.lora is not None:
            return {"model": self.lora.trainable_state(model), "lora_base": self.lora.base_fingerprint(),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        return {"model": {k: v.detach().cpu().clone() for k, v in model.items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.lora is not None:
            self.lora.check_base(state.get("lora_base"))
            self.lora.load_trainable_state(state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def save_with_tokenizer(model: torch.nn.Module, source_dir: str, path: str,
                        state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``model.save_pretrained(path)`` plus the tokenizer files of ``source_dir``.

    ``state_dict`` replaces the model's own tensors (a sharded engine's gathered weights).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, **({"state_dict": state_dict} if state_dict is not None else {}))
    copy_tokenizer_files(source_dir, out)


def copy_tokenizer_files(source_dir: str, out: Path) -> None:
    """Copy the tokenizer files of the model directory ``source_dir`` into ``out``."""
    for f in Path(source_dir).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                        "merges.txt", "chat_template.jinja")):
            shutil.copy(f, out / f.name)


def load_named_weights(model: torch.nn.Module, weights: NamedTensors) -> int:
    """Copy ``(name, tensor)`` pairs into ``model`` in place; unknown names raise. Returns the count."""
    params = model.state_dict(keep_vars=True)
    n = 0
    with torch.no_grad():
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of the generator")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            n += 1
    return n


class HFGenerateOptions(GenerateOptions):
    """``policy.generate`` of the Transformers generate engine."""

    micro_batch_size: int = Field(256, ge=1, description="hf: prompts per generate call")


@ENGINES.register("hf.generate")
class HFGenerateEngine(GenerateEngine):
    """Sampling with a Transformers model; logprobs of the temperature-scaled distribution.

    Two paths. Unkeyed (``seeds=None``): ``model.generate`` on torch's global RNG, seeded per
    call from ``params.seed`` or the spec's seed and rank plus a call count (``rng_state``); the
    quickstart's numbers depend on it, so it stays as it is, one call at a time. Keyed (``seeds``
    given): ``hf_decode.decode_keyed``, one generator per row, so a row depends only on its seed,
    its prompt and the weights (see that module for what is bit-exact).

    Concurrency: every call may come from its own thread. ``self.gate`` (``hf_decode.WeightGate``)
    serialises the model's use: a keyed call holds it for one token step at a time, an unkeyed
    call for the whole call (it owns the global RNG meanwhile), a weight load for the copy. A sync
    (``receive_weights`` ... ``end_sync``) pauses the keyed calls at a token boundary from its
    first bucket to its end, so each token is sampled by one whole set of weights, stamped with
    its version; ``SamplingParams.on_update`` says what a call does with its unfinished rows.

    Attributes:
        step_hook: a test seam: called with the step index before each token step of a keyed
            call, outside the gate (a test runs a sync there to land it at a known token).
    """

    Options = HFGenerateOptions
    pauses_mid_generation = True

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        self.hf = HFModel(self.spec)
        self.model = self.hf.model.eval().requires_grad_(False)
        cfg = self.model.config
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.eos_ids = _as_list(getattr(self.model.generation_config, "eos_token_id", None) or cfg.eos_token_id)
        self._calls = 0
        self.gate = WeightGate()
        self.step_hook: StepHook | None = None

    @property
    def version(self) -> int:  # type: ignore[override]
        return self.gate.version

    @version.setter
    def version(self, value: int) -> None:
        self.gate.version = value

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> GenerationOutput:
        """``B`` continuations in micro-batches of ``options.micro_batch_size`` prompts: keyed
        (``decode_keyed``, one seed per prompt) or not (``model.generate``); see the class."""
        if seeds is None:
            out = self._generate_unkeyed(prompts, params)
            return out if params.logprobs else dataclasses.replace(out, logprobs=[])  # the contract of base.py
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt")
        mbs = self.options.micro_batch_size
        stop = params.stop_token_ids or self.eos_ids
        out = GenerationOutput([], [], [])
        for start in range(0, len(prompts), mbs):
            part = decode_keyed(self.model, prompts[start:start + mbs], seeds[start:start + mbs], params,
                                self.gate, self.pad_id, stop, self.step_hook)
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs
            out.versions += part.versions
        return out if params.logprobs else dataclasses.replace(out, logprobs=[])

    def _generate_unkeyed(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        mbs = self.options.micro_batch_size
        token_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        with self.gate.step():  # the global RNG and the weights are this call's until it returns
            seed = params.seed if params.seed is not None else self.spec.seed * 100003 + self.spec.dist.rank * 7919
            torch.manual_seed(seed + self._calls)
            self._calls += 1
            for start in range(0, len(prompts), mbs):
                ids, lps = self._generate_chunk(prompts[start:start + mbs], params)
                token_ids += ids
                logprobs += lps
            version = self.version
        return GenerationOutput(token_ids, logprobs, [[version] * len(t) for t in token_ids])

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        stop = params.stop_token_ids or self.eos_ids
        greedy = params.temperature <= 0
        out = self.model.generate(
            input_ids=ids.to(self.hf.device), attention_mask=attn.to(self.hf.device),
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p, top_k=params.top_k or None,
            max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens if params.ignore_eos else 0,
            eos_token_id=None if params.ignore_eos else stop, pad_token_id=self.pad_id,
            output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1)[:, :new.shape[1]]
        lp = token_logprobs(logits, new.to(logits.device), params.temperature).cpu()
        return _truncate(new, lp, set(stop), params.ignore_eos)

    def update_weights(self, weights: NamedTensors) -> None:
        """Load ``weights``; waits for the running token step, if any (a direct call changes the
        weights of running keyed calls between two tokens but not their version)."""
        with self.gate.load():
            load_named_weights(self.model, weights)

    def receive_weights(self, transport: Transport, messages: list[Message] | None = None) -> int:
        """A bucket of a sync; the first pauses the keyed calls until ``end_sync``.

        A bucket that raises ends the pause: the run stops on the error, and the calls under
        way finish (on partly loaded weights, stamped with the old version) instead of hanging."""
        self.gate.pause()
        try:
            return super().receive_weights(transport, messages)
        except BaseException:
            self.gate.resume()
            raise

    def end_sync(self, version: int | None = None) -> None:
        """Set the version and let the paused calls sample on, by their ``on_update``."""
        self.gate.resume(version)
        self.wake_up()

    def rng_state(self) -> dict[str, Any]:
        return {"calls": self._calls}  # the seed of a call is a function of this count

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self._calls = state.get("calls", self._calls)

    def weight_checksums(self) -> dict[str, int]:
        from xrlhf.weight_sync import checksum

        return {name: checksum(t) for name, t in self.model.state_dict().items()}


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]


def _truncate(tokens: torch.Tensor, logprobs: torch.Tensor, stop: set[int], ignore_eos: bool):
    """Cut each row after its first stop token (kept); ``[B, N]`` -> lists."""
    ids_out, lps_out = [], []
    for row, lps in zip(tokens.tolist(), logprobs.tolist()):
        end = len(row)
        if not ignore_eos:
            for j, t in enumerate(row):
                if t in stop:
                    end = j + 1
                    break
        ids_out.append(row[:end])
        lps_out.append(lps[:end])
    return ids_out, lps_out
