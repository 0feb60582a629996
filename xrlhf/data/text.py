"""Text <-> token ids for prompts and responses, the same way in warm-up, RL and eval."""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence


@lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    """The tokenizer saved beside a local model (never the hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Prompt ids, no EOS.

    Args:
        tokenizer: the policy's tokenizer.
        prompt: a ``str`` (BOS when the tokenizer has one + the text's tokens), or a
            :class:`xrlhf.envs.Prompt`-like object: with ``messages`` (not ``None``) the chat
            template applied to them with the generation prompt
            (:meth:`xrlhf.data.chat.ChatFormat.prompt_ids`), else its ``text`` as a ``str``.

    Returns:
        ``list[int]`` of length P.

    Raises:
        ValueError: for messages and a tokenizer without a chat template (one line).
    """
    if not isinstance(prompt, str):
        if getattr(prompt, "messages", None) is not None:
            from xrlhf.data.chat import ChatFormat

            return ChatFormat(tokenizer).prompt_ids(prompt.messages)
        prompt = prompt.text
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def encode_target(tokenizer, text: str) -> list[int]:
    """Completion ids for supervised targets: the text's tokens + EOS."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def decode_responses(tokenizer, responses: Sequence[Sequence[int]]) -> list[str]:
    """Response texts without special tokens (the stop token included in the ids is dropped)."""
    return tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)
