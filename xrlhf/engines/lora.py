"""LoRA through PEFT for the train engines (``hf`` and ``deepspeed``): options, wrapping, weights.

Why a module of its own: both train backends share it, and everything LoRA changes about a
train engine is here, so a backend adds a handful of lines: wrap the model (``LoraModel``),
hold an ``AdapterWeights`` that hands its weights out and saves them, checkpoint through the
``LoraModel``. Nothing here imports PEFT at module level: validation reads ``LoraOptions``
without PEFT installed.

What LoRA changes (docs/lora.md):

* **Only the adapters train.** ``apply_lora`` freezes the base and adds ``B A`` (rank ``r``)
  beside each targeted linear layer, ``W x + alpha / r * B A x``; ``B`` starts at zero, so the
  wrapped model computes exactly what the base does. The optimizer holds the adapters only.
  A value or score head (a critic) is new, so it trains in full (PEFT's ``modules_to_save``).
* **The base is the reference.** With the adapters switched off (``LoraModel.base_weights``)
  the model is the start model, bit for bit: a reference computed that way needs no second copy.
* **Weights leave in one of two forms** (``LoraOptions.sync``): ``merged`` turns the PEFT
  state dict into the base's own names with ``W + alpha / r * B A`` (the generator gets
  ordinary full weights; the trained model is never modified), ``adapter`` sends only the
  ``lora_A`` / ``lora_B`` tensors in PEFT's file naming (a generator that loads adapters).
  Both are streams over a state-dict stream, so a ZeRO-3 engine feeds them its bucket-by-bucket
  gather and a merged layer never waits for more than its own ``A`` and ``B``.
* **Checkpoints hold the trainable tensors only** (adapters, a critic's head) and the optimizer
  states of those; the base comes back from the model directory, which does not change.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from xrlhf.engines.model_files import copy_tokenizer_files, save_with_tokenizer

PEFT_PREFIX = "base_model.model."
"""Where PEFT's ``PeftModel`` puts the wrapped model's own names in its state dict."""
ADAPTER = "default"
"""The name of the one adapter xrlhf trains (PEFT's default)."""
HEAD_NAMES = ("lm_head", "score", "classifier")
"""Output layers LoRA never adapts: the LM head (tied to the input embedding in many models)
and a critic's or reward model's head (new, so trained in full)."""


class LoraOptions(BaseModel):
    """``<handle>.train.lora``: train low-rank adapters instead of every weight."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1, le=1024, description="r, the adapters' inner dimension")
    alpha: float | None = Field(None, gt=0, description="the update is alpha / rank * B A x; default 2 x rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (needs the section's "
                           "dropout: true; off by default, as all dropout in RL)")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="names (last component) of the linear layers to adapt, e.g. [q_proj, v_proj]; "
        "all-linear: every linear layer but the output head")
    sync: Literal["merged", "adapter"] = Field(
        "merged", description="what a weight sync sends the generator: merged full weights (W + alpha/r B A; any "
        "generate engine) or the adapter tensors only (a generate engine that loads LoRA adapters: vllm)")
    save: Literal["merged", "adapter"] = Field(
        "merged", description="what save_pretrained (final/, the warm-up's output) writes: the merged model in HF "
        "format, or the PEFT adapter (adapter_config.json + adapter_model.safetensors) and the tokenizer")

    @field_validator("target_modules")
    @classmethod
    def _some(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("name at least one linear layer, or all-linear")
        return v

    @property
    def lora_alpha(self) -> float:
        """``alpha``, or its default ``2 * rank``."""
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @property
    def scaling(self) -> float:
        """``alpha / rank``: the factor of ``B A``."""
        return self.lora_alpha / self.rank


LORA_FIELD = Field(None, description="train LoRA adapters (PEFT) instead of every weight; unset: full fine-tuning")
"""The ``lora`` field of the train options of a backend that trains adapters through this module
(``hf``, ``deepspeed``): ``lora: LoraOptions | None = LORA_FIELD``."""


def dropout_errors(options: BaseModel, path: str) -> list[str]:
    """What is wrong with train options' ``lora`` beside their ``dropout`` (``path``: the
    section's YAML path); the options' ``model_validator`` raises them."""
    lora = getattr(options, "lora", None)
    if lora is not None and lora.dropout > 0 and not options.dropout:
        return [f"{path}.lora.dropout: {lora.dropout:g} needs {path}.dropout: true (train engines run without "
                f"dropout unless the section asks for it); set it to 0 or set dropout: true"]
    return []


# -- the run: the policy's adapter and the reference ---------------------------------------------
# -- the model's linear layers: what target_modules may name ------------------------------------
def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's transposed linear


def linear_layers(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """``(adaptable, heads)``: full names of the linear layers LoRA may adapt, and of the output
    heads it never adapts (linear layers right under the model's root, e.g. ``lm_head``, ``score``)."""
    adaptable, heads = [], []
    for name, module in model.named_modules():
        if _is_linear(module):
            (heads if "." not in name or name.split(".")[-1] in HEAD_NAMES else adaptable).append(name)
    return adaptable, heads


def resolve_targets(options: LoraOptions, adaptable: list[str]) -> tuple[list[str], list[str]]:
    """``(targets, unknown)``: the last-component names LoRA adapts (sorted), and the names of
    ``options.target_modules`` that match no adaptable layer."""
    suffixes = sorted({n.split(".")[-1] for n in adaptable})
    if options.target_modules == "all-linear":
        return suffixes, []
    unknown = [t for t in options.target_modules if t not in suffixes]
    return sorted(set(options.target_modules) - set(unknown)), unknown


def meta_model(model_dir: str, head: str) -> torch.nn.Module:
    """The model of ``model_dir`` with ``head`` built on the meta device: no weights read."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)

    kwargs = {} if head == "causal_lm" else {"num_labels": 1}
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, **kwargs)
    auto = {"causal_lm": AutoModelForCausalLM, "value": AutoModelForTokenClassification,
            "score": AutoModelForSequenceClassification}[head]
    with torch.device("meta"):
        return auto.from_config(config)


def target_errors(options: LoraOptions, where: str, model_dir: str, head: str) -> list[str]:
    """One line if ``options.target_modules`` names a layer the model at ``model_dir`` does not
    have as an adaptable linear layer; ``where`` is the YAML path of the ``lora`` section."""
    adaptable, heads = linear_layers(meta_model(model_dir, head))
    targets, unknown = resolve_targets(options, adaptable)
    if not unknown and targets:
        return []
    names = ", ".join(sorted({n.split(".")[-1] for n in adaptable})) or "none"
    what = f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not" if unknown else "none is"
    head_names = ", ".join(sorted({h.split(".")[-1] for h in heads}))
    head_note = f" ({head_names}: output heads are not adapted)" if heads else ""
    return [f"{where}.target_modules: {what} a linear layer of {model_dir} that LoRA can adapt; its linear layers: "
            f"{names}{head_note}; or all-linear"]


def adapter_params(model_dir: str, head: str, options: LoraOptions) -> int:
    """How many parameters the adapters of ``options`` add to the model at ``model_dir``."""
    model = meta_model(model_dir, head)
    adaptable, _ = linear_layers(model)
    targets, _ = resolve_targets(options, adaptable)
    total = 0
    for name in adaptable:
        if name.split(".")[-1] in targets:
            w = model.get_submodule(name).weight  # Linear: [out, in]; GPT-2's Conv1D: [in, out]
            total += options.rank * (w.shape[0] + w.shape[1])
    return total


# -- wrapping --------------------------------------------------------------------------------------
def apply_lora(model: torch.nn.Module, options: LoraOptions, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """``model`` wrapped by PEFT with ``options``' adapters: the base frozen, the adapters (and
    an output head that is not a language model's) trainable. Returns the ``PeftModel``.

    The adapters are created on the model's device; PEFT keeps them in float32 over a bf16 or
    fp16 base (``autocast_adapter_dtype``). With gradient checkpointing the inputs of the
    checkpointed blocks must require gradients, or the frozen base would stop them there.
    """
    from peft import LoraConfig, get_peft_model

    adaptable, heads = linear_layers(model)
    targets, unknown = resolve_targets(options, adaptable)
    if unknown or not targets:
        raise ValueError(f"lora.target_modules: {unknown or options.target_modules} match no adaptable linear layer")
    is_lm = getattr(model, "get_output_embeddings", lambda: None)() is not None
    heads_to_train = None if is_lm else sorted({h.split(".")[-1] for h in heads}) or None
    config = LoraConfig(r=options.rank, lora_alpha=options.lora_alpha, lora_dropout=options.dropout,
                        target_modules=targets, bias="none", modules_to_save=heads_to_train)
    peft_model = get_peft_model(model, config)
    if gradient_checkpointing:
        peft_model.enable_input_require_grads()
    return peft_model


class LoraModel:
    """A ``PeftModel`` as a train engine sees it: its trainable tensors, its base, its weights by
    HF name (merged or as adapters), saving. One per train engine, built on ``apply_lora``'s result.

    Args:
        model: the ``PeftModel`` (for DeepSpeed: the engine's ``module``).
        options: the section's ``LoraOptions``.
    """

    def __init__(self, model: torch.nn.Module, options: LoraOptions):
        self.model, self.options = model, options
        self.layers: dict[str, tuple[float, bool]] = {}
        """Adapted layer (name in the base model) -> (scaling, fan_in_fan_out)."""
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and ADAPTER in getattr(module, "lora_A", {}):
                self.layers[name.removeprefix(PEFT_PREFIX)] = (float(module.scaling[ADAPTER]),
                                                                bool(getattr(module, "fan_in_fan_out", False)))
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        """Names (PEFT's, as in ``model.state_dict()``) of the tensors that train."""

    @contextmanager
    def base_weights(self) -> Iterator[None]:
        """The adapters (and a trained head) switched off: the model computes its start model."""
        with self.model.disable_adapter():
            yield

    # -- weights out ------------------------------------------------------------------------
    def merged(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base model's weights by its own (HF) names, each adapted layer's weight replaced by
        ``W + scaling * B A`` (computed in float32, cast to ``W``'s dtype), from ``items``: the
        ``PeftModel``'s ``state_dict`` pairs, in their order (a ZeRO-3 gather may stream them).

        Shapes: ``W`` ``[out, in]`` (GPT-2's Conv1D: ``[in, out]``), ``A`` ``[r, in]``, ``B``
        ``[out, r]``. An adapted layer's base tensors wait for its ``A`` and ``B`` (which follow
        them in a state dict), so at most one layer is held at a time. Nothing is modified.
        """
        held: dict[str, dict[str, Any]] = {}
        for key, t in items:
            name = key.removeprefix(PEFT_PREFIX)
            if ".original_module." in name:  # a trained head's frozen original: the trained copy is the weight
                continue
            name = name.replace(f".modules_to_save.{ADAPTER}.", ".")
            layer, part = _lora_part(name)
            if layer is None:
                if ".base_layer." not in name or name.split(".base_layer.")[0] not in self.layers:
                    yield name.replace(".base_layer.", "."), t
                    continue
                layer, part = name.split(".base_layer.")
                held.setdefault(layer, {"base": []})["base"].append((part, t))
            elif part in ("A", "B"):
                held.setdefault(layer, {"base": []})[part] = t
            else:
                raise ValueError(f"LoRA: cannot merge {key!r} (only lora_A / lora_B adapters are supported)")
            entry = held.get(layer)
            if entry is not None and "A" in entry and "B" in entry and any(p == "weight" for p, _ in entry["base"]):
                del held[layer]
                yield from self._merge_layer(layer, entry)
        if held:
            raise RuntimeError(f"LoRA merge: incomplete layers at the end of the weights: {sorted(held)[:3]}")

    def _merge_layer(self, layer: str, entry: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        scaling, fan_in_fan_out = self.layers[layer]
        a, b = entry["A"], entry["B"]
        for part, t in entry["base"]:
            if part == "weight":
                delta = (b.to(t.device, torch.float32) @ a.to(t.device, torch.float32)) * scaling  # [out, in]
                t = (t.float() + (delta.T if fan_in_fan_out else delta)).to(t.dtype)
            yield f"{layer}.{part}", t

    def adapters(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``lora_A`` / ``lora_B`` tensors of ``items`` (``state_dict`` pairs) under the names
        of PEFT's ``adapter_model.safetensors`` (``base_model.model.<layer>.lora_A.weight``)."""
        for key, t in items:
            if is_adapter(key):
                yield key.replace(f".{ADAPTER}.", "."), t

    def adapter_config(self, base_model_path: str) -> dict[str, Any]:
        """The ``adapter_config.json`` of these adapters (what PEFT writes, and vLLM reads)."""
        targets = sorted({n.split(".")[-1] for n in self.layers})
        o = self.options
        return {"peft_type": "LORA", "task_type": None, "r": o.rank, "lora_alpha": o.lora_alpha,
                "lora_dropout": o.dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
                "use_rslora": False, "use_dora": False, "modules_to_save": None,
                "base_model_name_or_path": base_model_path}

    # -- state ------------------------------------------------------------------------------
    def trainable_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The trainable tensors of ``state`` (the model's ``state_dict``), copied to the CPU."""
        return {k: state[k].detach().cpu().clone() for k in self.trainable}

    def base_fingerprint(self) -> int:
        """One checksum of the frozen tensors (this rank's partitions under ZeRO-3): a checkpoint
        holds the adapters only, so on resume the base must be the very one they were trained on."""
        from xrlhf.weight_sync import checksums

        frozen = (getattr(p, "ds_tensor", p) for p in self.model.parameters() if not p.requires_grad)
        return sum(checksums(frozen)) % (1 << 64)

    def check_base(self, fingerprint: int | None) -> None:
        """Raise ``ValueError`` if ``fingerprint`` (saved with a checkpoint) is not this base's."""
        if fingerprint is not None and fingerprint != self.base_fingerprint():
            raise ValueError("LoRA checkpoint: the base model under the adapters is not the one they were trained on "
                             "(was the model directory changed?); resume from the same model")

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``trainable_state``'s tensors; every trainable tensor must be there, and nothing else.

        Raises:
            ValueError: naming what is missing or unexpected (a checkpoint of another model or LoRA setting).
        """
        missing, unexpected = sorted(set(self.trainable) - set(state)), sorted(set(state) - set(self.trainable))
        if missing or unexpected:
            raise ValueError(f"LoRA checkpoint does not match the model's adapters: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]} (was it saved with other policy.train.lora options?)")
        self.model.load_state_dict(state, strict=False)

    def save(self, path: str, source_dir: str, items: Iterable[tuple[str, torch.Tensor]], write: bool) -> None:
        """Write ``options.save``'s form to ``path`` from ``items`` (``state_dict`` pairs; every
        rank of a ZeRO-3 engine must pass its gather, ``write`` on one): the merged model in HF
        format, or the adapter in PEFT's format; with the tokenizer files of ``source_dir``."""
        if not write:  # a ZeRO-3 rank that only takes part in the gather
            for _ in items:
                pass
            return
        if self.options.save == "merged":
            state = {n: t.cpu() for n, t in self.merged(items)}
            save_with_tokenizer(self.model.get_base_model(), source_dir, path, state_dict=state)
            return
        state = {n: t.cpu().contiguous() for n, t in self.adapters(items)}
        save_adapter(path, state, self.adapter_config(source_dir), source_dir)


def adapter_of(options: BaseModel) -> LoraOptions | None:
    """The adapter train options ask for (their ``lora``), or ``None``: a train engine's
    ``adapter_options`` hook (``TrainEngine.adapter_options``)."""
    return getattr(options, "lora", None)  # a subclass's own Options may leave LoRA out


def model_errors(options: BaseModel, where: str, model_dir: str, head: str) -> list[str]:
    """What the LoRA of ``options`` cannot do with the model at ``model_dir``: a train engine's
    ``model_errors`` hook (``TrainEngine.model_errors``)."""
    import importlib.util

    lora = adapter_of(options)
    if lora is None:
        return []
    if importlib.util.find_spec("peft") is None:
        return [f"{where}.lora: needs the peft package, which is not installed; install it with "
                f"pip install -e '.[lora]'"]
    return target_errors(lora, f"{where}.lora", model_dir, head)


class AdapterWeights:
    """How a train engine's weights leave it: as they are, or through its LoRA adapters (merged,
    or the adapter tensors alone) as the LoRA options say. A part the engine holds
    (``self.weights``); its ``named_weights``, ``weights_for_sync``, ``save_pretrained`` and
    ``infer_base`` delegate here.

    Args:
        lora: the engine's ``LoraModel``; ``None``: every weight trains.
        state_items: ``state_items(keep=None)``, the model's state-dict pairs whose key ``keep``
            accepts (all when ``None``), gathered if sharded: a collective on every rank then.
        save_full: ``save_full(path)``: save in HF format as without LoRA (every rank calls it).
        model_path: the model directory (its tokenizer files; an adapter's base).
        writes: this rank writes what ``save`` saves (rank 0; the others only join a gather).
    """

    def __init__(self, lora: LoraModel | None, state_items: Callable[..., Iterator[tuple[str, torch.Tensor]]],
                 save_full: Callable[[str], None], model_path: str, writes: bool):
        self.lora, self.state_items, self.save_full = lora, state_items, save_full
        self.model_path, self.writes = model_path, writes

    @contextmanager
    def base(self) -> Iterator[None]:
        """The adapters off: the model computes its start model (a reference without a copy).

        Raises:
            NotImplementedError: without LoRA (every weight trains; no start model is kept).
        """
        if self.lora is None:
            raise NotImplementedError(f"the train engine of {self.model_path} trains every weight and keeps no base "
                                      f"model; the reference needs a model of its own")
        with self.lora.base_weights():
            yield

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights in HF naming; with LoRA the base's names with ``B A`` merged in."""
        items = self.state_items()
        yield from items if self.lora is None else self.lora.merged(items)

    def for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``named``, or with ``lora.sync: adapter`` the adapter tensors only."""
        if self.lora is not None and self.lora.options.sync == "adapter":
            return self.lora.adapters(self.state_items(is_adapter))
        return self.named()

    def save(self, path: str) -> None:
        """Without LoRA ``save_full``; with it ``LoraModel.save``'s form (every rank takes part, ``writes`` writes)."""
        if self.lora is None:
            self.save_full(path)
            return
        keep = None if self.lora.options.save == "merged" else is_adapter
        self.lora.save(path, self.model_path, self.state_items(keep), write=self.writes)


def _lora_part(name: str) -> tuple[str | None, str | None]:
    """``(layer, "A" | "B" | other)`` for an adapter tensor's name, ``(None, None)`` otherwise."""
    for marker in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector."):
        if marker in name:
            layer = name.split(marker)[0]
            return layer, {".lora_A.": "A", ".lora_B.": "B"}.get(marker, marker.strip("."))
    return None, None


def is_adapter(key: str) -> bool:
    """Whether a ``PeftModel`` state-dict key is a LoRA adapter tensor (``lora_A`` / ``lora_B``)."""
    return f".lora_A.{ADAPTER}." in key or f".lora_B.{ADAPTER}." in key


def save_adapter(path: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], source_dir: str) -> None:
    """A PEFT adapter directory: ``adapter_config.json``, ``adapter_model.safetensors`` (``tensors``
    by PEFT's names) and the tokenizer files of ``source_dir`` (loadable with
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)``)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer_files(source_dir, out)
