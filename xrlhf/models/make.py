"""``xrlhf make-tiny-model DIR``: write a locally built model and tokenizer (Llama of
:mod:`xrlhf.models.tiny`, or a Qwen2- / GPT-2-style one of :mod:`xrlhf.models.archs`).

Why a module apart from ``tiny``: the command reaches both builders, and ``archs`` builds on
``tiny``'s tokenizer; here they meet without ``tiny`` importing ``archs`` back.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loguru import logger

from xrlhf.models.archs import build_arch_model
from xrlhf.models.tiny import DTYPES, PRESETS, build_model, count_params
from xrlhf.utils.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``xrlhf make-tiny-model DIR`` to ``parser``.

    Size flags left out take their value from ``--preset``.
    """
    parser.add_argument("dir", type=Path, help="model directory to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="named size; the flags below override its values (default: tiny)")
    for flag, kind, help_ in (
        ("--layers", int, "decoder layers"), ("--hidden", int, "hidden size"),
        ("--heads", int, "attention heads"), ("--kv-heads", int, "key/value heads (GQA)"),
        ("--intermediate", int, "MLP width (default 4 x hidden)"),
        ("--max-positions", int, "longest sequence"),
        ("--vocab-size", int, "BPE vocabulary size"), ("--seed", int, "initialisation seed"),
    ):
        parser.add_argument(flag, type=kind, default=None, help=help_)
    parser.add_argument("--tokenizer", choices=["char", "bpe"], default=None, help="tokenizer kind")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="dtype of the weights")
    parser.add_argument("--arch", choices=["llama", "qwen2", "gpt2"], default="llama",
                        help="llama (default), or a Qwen2- / GPT-2-style model with the char tokenizer "
                             "(xrlhf.models.archs; uses --layers/--hidden/--heads/--max-positions/--seed/--dtype)")


def run(args: argparse.Namespace) -> int:
    """Build the model that ``args`` (from :func:`add_arguments`) describes; returns 0.

    Raises:
        xrlhf.utils.errors.UserError: for inconsistent sizes, naming the flag's value.
    """
    kwargs = {**PRESETS[args.preset]}
    for key in ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_positions",
                "tokenizer", "vocab_size", "seed", "dtype"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    try:
        if getattr(args, "arch", "llama") != "llama":
            keys = ("layers", "hidden", "heads", "max_positions", "seed", "dtype")
            kwargs = {k: v for k, v in kwargs.items() if k in keys}
            out = build_arch_model(args.dir, args.arch, **kwargs)
        else:
            out = build_model(args.dir, **kwargs)
    except ValueError as e:
        raise UserError(f"make-tiny-model: {e}") from None
    logger.info(f"wrote a {count_params(out):,}-parameter model to {out} ({kwargs})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m xrlhf.models.make DIR [--preset ...]``."""
    parser = argparse.ArgumentParser(prog="xrlhf make-tiny-model", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
