"""Build a randomly initialised Llama model and its tokenizer locally, with no hub access.

Every CPU test and every tutorial needs a model, and none of them may download one. This
module makes a complete Hugging Face model directory (``config.json``, safetensors weights,
``generation_config.json``, ``tokenizer.json``) from a few numbers, so ``from_pretrained`` in
any engine (HF, DeepSpeed, vLLM) loads it like a hub checkpoint.

Two tokenizers are built with the ``tokenizers`` library:

* ``"char"``: one token per printable ASCII character. A 2-layer model learns the arithmetic
  and sorting tasks of :mod:`xrlhf.envs.reasoning` with it in minutes on a laptop, because the
  digits of a number are separate tokens.
* ``"bpe"``: a byte-level BPE trained on the spot (on a given corpus, or on a generated one of
  arithmetic and English-like text), for the GPU-sized presets whose throughput should look
  like a real model's.

Both have the same special tokens: ``<pad>`` (id 0), ``<s>``, ``</s>``, ``<unk>``; neither adds
any of them on its own, so the trainer decides where BOS and EOS go.

Both also carry :data:`CHAT_TEMPLATE` (saved as ``chat_template.jinja``), so multi-turn envs run
on the tiny models; it adds no character the char tokenizer lacks, so the vocabulary and weights
are unchanged. How it renders, and why the generation prompt ends in a newline: docs/chat.md.

The CLI subcommand ``xrlhf make-tiny-model DIR`` is :mod:`xrlhf.models.make`.
"""

from __future__ import annotations

import inspect
import random
import string
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import torch
from loguru import logger
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
"""The special tokens of both tokenizers, in id order: ``<pad>`` is 0, ``<s>`` 1, ``</s>`` 2."""

CHARS = [c for c in string.printable if c not in "\x0b\x0c"]
"""The 98 characters of the char tokenizer: digits, letters, punctuation, space, \\t, \\n, \\r."""

CHAT_TEMPLATE = (
    "{{- '<s>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'system' %}{{ 'S: ' + message['content'] + '\\n' }}\n"
    "    {%- elif message['role'] == 'user' %}{{ 'U: ' + message['content'] + '\\n' }}\n"
    "    {%- elif message['role'] == 'tool' %}{{ 'T: ' + message['content'] + '\\n' }}\n"
    "    {%- elif message['role'] == 'assistant' %}{{ 'A:\\n' + message['content'] + '</s>\\n' }}\n"
    "    {%- else %}{{ raise_exception('the tiny chat template has no role ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ 'A:\\n' }}{% endif %}"
)
"""The Jinja chat template of both tiny tokenizers (see the module docstring): ``<s>``, then
``S: ``/``U: ``/``T: `` + content + newline for system/user/tool, ``A:\\n`` + content + ``</s>\\n``
for the assistant; the generation prompt is ``A:\\n``."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PRESETS: dict[str, dict[str, Any]] = {
    # 2 x (4*64*64 + 3*64*256 + 2*64) + 128*64 + 64 = 139,584 params (char vocab padded to 128).
    "tiny": dict(layers=2, hidden=64, heads=4),
    # 4 x (4*256*256 + 3*256*1024 + 2*256) + 128*256 + 256 = 4,229,376 params.
    "small": dict(layers=4, hidden=256, heads=8, max_positions=512),
    # 24 x (4*1024^2 + 3*1024*4864 + 2*1024) + 32000*1024 + 1024 = 492,094,464 params, the size
    # of Qwen2.5-0.5B (its extra params are in a 152k vocabulary); intermediate 2816 would give
    # only 341M, so the MLP is widened to Qwen's 4864 rather than the model made deeper.
    "0.5b": dict(layers=24, hidden=1024, heads=16, kv_heads=16, intermediate=4864,
                 tokenizer="bpe", vocab_size=32000, max_positions=2048),
    # The attention of Qwen2.5-0.5B (grouped-query: 2 key/value heads, so an 8x smaller KV cache
    # than "0.5b"); 24 x (2*1024^2 + 2*1024*128 + 3*1024*5440 + 2*1024) + 32000*1024 + 1024 =
    # 490,521,600 params, the MLP widened to 5440 to keep the size.
    "0.5b-gqa": dict(layers=24, hidden=1024, heads=16, kv_heads=2, intermediate=5440,
                     tokenizer="bpe", vocab_size=32000, max_positions=2048),
    # 28 x (4*1536^2 + 3*1536*8960 + 2*1536) + 32000*1536 + 1536 = 1,469,535,744 params, the
    # shape of Qwen2.5-1.5B (28 layers, 1536 wide, MLP 8960) without its grouped KV heads.
    "1.5b": dict(layers=28, hidden=1536, heads=12, kv_heads=12, intermediate=8960,
                 tokenizer="bpe", vocab_size=32000, max_positions=2048),
    # The shape of Qwen2.5-7B (28 layers, 3584 wide, MLP 18944, 28 heads, 4 key/value heads) and
    # its untied output head, with the BPE vocabulary of the presets above instead of Qwen's 152k
    # and no attention biases: 28 x (2*3584^2 + 2*3584*512 + 3*3584*18944 + 2*3584)
    # + 2*32000*3584 + 3584 = 6,754,868,736 params (Qwen2.5-7B: 7,615,616,512).
    "7b": dict(layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944,
               tokenizer="bpe", vocab_size=32000, max_positions=2048, tie_embeddings=False),
}
"""Named model sizes for ``build_model(**PRESETS[name])``; all but ``7b`` (Qwen2.5-7B unties them)
tie input and output embeddings."""


def build_tokenizer(kind: Literal["char", "bpe"] = "char", corpus: Iterable[str] | None = None,
                    vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Build a fast tokenizer without downloading anything.

    Args:
        kind: ``"char"`` (one token per printable ASCII character; ``corpus`` and
            ``vocab_size`` are ignored) or ``"bpe"`` (byte-level BPE trained here).
        corpus: texts to train the BPE on; ``None`` uses :func:`default_corpus`.
        vocab_size: the BPE vocabulary size, special tokens included. A corpus too small to
            yield that many merges gives a smaller vocabulary (logged as a warning).

    Returns:
        A ``PreTrainedTokenizerFast`` with pad (id 0), bos, eos and unk set and
        :data:`CHAT_TEMPLATE` as its ``chat_template``, which adds no special tokens when
        encoding and decodes without inserting spaces.

    Raises:
        ValueError: for an unknown ``kind`` or a ``vocab_size`` too small for the byte alphabet.
    """
    if kind == "char":
        tok = _char_tokenizer()
    elif kind == "bpe":
        tok = _bpe_tokenizer(default_corpus() if corpus is None else corpus, vocab_size)
    else:
        raise ValueError(f"build_tokenizer: kind={kind!r} is not one of 'char', 'bpe'")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   **SPECIAL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _char_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS.values(), *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # `[\s\S]` rather than `.`: Oniguruma's `.` does not match a newline.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def _bpe_tokenizer(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"build_tokenizer: vocab_size={vocab_size} is below the "
                         f"{len(alphabet) + len(SPECIAL_TOKENS)} tokens of the byte alphabet")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() < vocab_size:
        logger.warning(f"BPE vocabulary has {tok.get_vocab_size()} tokens, fewer than "
                       f"vocab_size={vocab_size}: the corpus has too few distinct merges")
    return tok


def default_corpus(lines: int = 20_000, seed: int = 0) -> Iterator[str]:
    """A generated corpus for the BPE: arithmetic, sorting and parity lines among sentences of
    English-like made-up words (enough distinct words for a 32k vocabulary).

    Args:
        lines: how many lines to yield.
        seed: the corpus is a function of ``(lines, seed)``.
    """
    rng = random.Random(seed)
    syllables = [c + v + e for c in "bcdfghjklmnprstvwz" for v in "aeiou" for e in ("", "n", "r", "s", "t")]
    common = "the of and to in is it that was for on are with as his they be at one have this".split()
    for i in range(lines):
        if i % 3 == 0:
            a, b = rng.randrange(1000), rng.randrange(1000)
            digits = " ".join(map(str, rng.sample(range(10), 4)))
            yield f"{a}+{b}={a + b}. {a}?{b}. sort {digits}: parity {rng.getrandbits(6):06b}: odd"
        else:
            words = [rng.choice(common) if rng.random() < 0.3 else
                     "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
                     for _ in range(rng.randint(5, 15))]
            yield " ".join(words).capitalize() + rng.choice([".", ",", "?", "!"])


def build_model(out_dir: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int | None = None, intermediate: int | None = None,
                max_positions: int = 256, tokenizer: Literal["char", "bpe"] = "char",
                vocab_size: int = 8192, seed: int = 0, dtype: str = "float32",
                tie_embeddings: bool = True) -> Path:
    """Write a randomly initialised ``LlamaForCausalLM`` and its tokenizer to ``out_dir``.

    The result is a function of the arguments alone: the same ``seed`` gives the same weights.

    Args:
        out_dir: the model directory (created; files already there are overwritten).
        layers, hidden, heads: depth, width and attention heads (``hidden % heads == 0``).
        kv_heads: key/value heads for grouped-query attention; ``None`` means ``heads``.
        intermediate: MLP width; ``None`` means ``4 * hidden``.
        max_positions: the longest sequence (also the tokenizer's ``model_max_length``).
        tokenizer: ``"char"`` or ``"bpe"`` (see :func:`build_tokenizer`).
        vocab_size: BPE vocabulary size (ignored for ``"char"``). The model's embedding is the
            tokenizer's vocabulary rounded up to a multiple of 64.
        seed: seeds ``torch`` before the weights are initialised.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for the saved weights (the
            initialisation is always float32, so the dtypes agree up to rounding).
        tie_embeddings: share the input embedding with the output projection.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: naming the argument, for inconsistent sizes or an unknown dtype.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    _check_sizes(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                 max_positions=max_positions, dtype=dtype)
    tok = build_tokenizer(tokenizer, vocab_size=vocab_size)
    tok.model_max_length = max_positions
    config = llama_config(tok, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, max_positions=max_positions,
                          tie_embeddings=tie_embeddings)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.to(DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _check_sizes(*, layers: int, hidden: int, heads: int, kv_heads: int, max_positions: int,
                 dtype: str) -> None:
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("kv_heads", kv_heads), ("max_positions", max_positions)):
        if value < 1:
            raise ValueError(f"build_model: {name}={value} must be at least 1")
    if hidden % heads:
        raise ValueError(f"build_model: hidden={hidden} is not divisible by heads={heads}")
    if heads % kv_heads:
        raise ValueError(f"build_model: heads={heads} is not divisible by kv_heads={kv_heads}")
    if dtype not in DTYPES:
        raise ValueError(f"build_model: dtype={dtype!r} is not one of {', '.join(DTYPES)}")


def llama_config(tok: PreTrainedTokenizerFast, *, layers: int, hidden: int, heads: int,
                 kv_heads: int | None = None, intermediate: int | None = None,
                 max_positions: int = 256, tie_embeddings: bool = True) -> LlamaConfig:
    """The ``LlamaConfig`` that :func:`build_model` saves, with the special ids of ``tok``."""
    return LlamaConfig(
        vocab_size=round_up(len(tok), 64), hidden_size=hidden,
        intermediate_size=4 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (vocabulary sizes: a multiple of 64)."""
    return -(-n // multiple) * multiple


def count_params(model_dir: str | Path) -> int:
    """The number of distinct parameters of the model in ``model_dir`` (tied ones once).

    The model is built on the meta device from ``config.json``, so nothing is allocated.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return _unique_numel(model)


def preset_config(name: str) -> LlamaConfig:
    """The ``LlamaConfig`` that ``build_model(**PRESETS[name])`` saves, without building the
    tokenizer: a BPE preset's vocabulary is taken as exactly ``vocab_size`` (the default corpus
    yields all of it), the special ids as both tokenizers number them (``SPECIAL_TOKENS``)."""
    defaults = {k: p.default for k, p in inspect.signature(build_model).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    spec = {**defaults, **PRESETS[name]}
    vocab = round_up(spec["vocab_size"] if spec["tokenizer"] == "bpe" else
                     len(SPECIAL_TOKENS) + len(CHARS), 64)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"] or 4 * spec["hidden"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"] or spec["heads"],
        max_position_embeddings=spec["max_positions"], tie_word_embeddings=spec["tie_embeddings"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


def preset_params(name: str) -> int:
    """The parameter count of ``PRESETS[name]``, counted on the meta device (no weights, and for
    BPE presets a tokenizer-free vocabulary of exactly ``vocab_size``)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(preset_config(name))
    return _unique_numel(model)


def _unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
