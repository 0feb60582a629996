"""Text <-> token ids for prompts and responses, the same way in warm-up, RL and eval."""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence


@lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    """The tokenizer saved beside a local model (never the hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt ids: BOS (when the tokenizer has one) + the text's tokens, no EOS."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def encode_target(tokenizer, text: str) -> list[int]:
    """Completion ids for supervised targets: the text's tokens + EOS."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def decode_responses(tokenizer, responses: Sequence[Sequence[int]]) -> list[str]:
    """Response texts without special tokens (the stop token included in the ids is dropped)."""
    return tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)
