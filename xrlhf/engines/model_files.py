"""An HF-format model directory on disk: ``save_pretrained`` plus the tokenizer files of the
directory the model came from.

Why a module of its own: the Transformers and DeepSpeed backends write it, and so does LoRA
(``engines.lora``: a merged model or a PEFT adapter); none of them should import another's
module for it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


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
