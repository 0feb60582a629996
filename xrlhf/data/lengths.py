"""Sequence lengths against a model's positions: a prompt plus what may follow it must fit.

What may follow is ``policy.generate.max_new_tokens`` for a one-turn sample, and the episode's
budget ``env.options.max_episode_tokens`` for an episode (every turn and observation; each turn's
``max_new_tokens`` is cut to what is left of it, so it is counted once, inside the budget).

Past its last position a model with learned positions (GPT-2's ``n_positions``) fails with an
``IndexError`` deep in its embedding, and a rotary one (``max_position_embeddings`` of Llama,
Qwen2, Mistral, Gemma2) runs on silently past the length it was trained on. Both are user
errors with one line: ``xrlhf validate`` checks the env's longest prompt, the trainer each
rollout's prompts.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from xrlhf.utils.errors import UserError

POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length", "seq_length")
"""Where configs keep their number of positions; ``n_positions``/``n_ctx`` are learned (GPT-2)."""


@lru_cache(maxsize=16)
def model_positions(model_dir: str) -> tuple[int, str] | None:
    """``(positions, config key)`` of the model in ``model_dir``, or ``None`` if its config names none."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # reported by the model checks of validation
    config = config.get("text_config") or config
    for key in POSITION_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key], key
    return None


def length_error(model_dir: str, prompt_tokens: int, new_tokens: int, what: str,
                 episode: bool = False) -> str | None:
    """One line if ``prompt_tokens + new_tokens`` exceed the positions of ``model_dir``.

    Args:
        model_dir: the model.
        prompt_tokens: the prompt's length.
        new_tokens: what may follow it: ``policy.generate.max_new_tokens``, or with ``episode``
            the episode's budget ``max_episode_tokens``.
        what: names the prompt (``"the longest prompt of env 'reasoning'"``, ``"the prompt '...'"``).
        episode: the sample is an episode: the line names ``env.options.max_episode_tokens``,
            the budget to lower.
    """
    limit = model_positions(model_dir)
    if limit is None or prompt_tokens + new_tokens <= limit[0]:
        return None
    n, key = limit
    kind = ("learned positions: the model fails beyond them" if key in ("n_positions", "n_ctx")
            else "beyond them the model runs past the length it was trained on")
    option, name, parts = (("env.options.max_episode_tokens", "max_episode_tokens",
                            " (the episode's turns and observations; each turn's max_new_tokens counts within it)")
                           if episode else ("policy.generate.max_new_tokens", "max_new_tokens", ""))
    fix = (f"lower it to at most {n - prompt_tokens}" if n > prompt_tokens
           else "the prompt alone is too long for this model; shorten the env's prompts (or use a model with more "
                "positions)")
    return (f"{option}: {what} ({prompt_tokens} tokens) + {name} {new_tokens}{parts} = {prompt_tokens + new_tokens} "
            f"exceeds the {n} positions of {model_dir} ({key} in config.json; {kind}); {fix}")


def check_prompt_lengths(ids: Sequence[Sequence[int]], texts: Sequence[str], max_new_tokens: int,
                         model_dir: str) -> None:
    """Raise ``UserError`` naming the longest prompt of ``ids`` if it cannot fit with its response."""
    if not ids:
        return
    i = max(range(len(ids)), key=lambda j: len(ids[j]))
    line = length_error(model_dir, len(ids[i]), max_new_tokens, f"the prompt {texts[i][:60]!r}")
    if line:
        raise UserError(line)
