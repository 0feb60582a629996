"""A model and tokenizer built locally load with the Auto classes and behave as documented."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from xrlhf.models import make, tiny
from xrlhf.models.tiny import build_model, build_tokenizer, count_params

TEXT = "12+7=19\nodd sort: 3 1 2"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def test_loads_with_auto_classes(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, len(TEXT), model.config.vocab_size)
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tok)
    assert model.config.pad_token_id == tok.pad_token_id == 0
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_char_tokenizer_round_trips(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    for text in (TEXT, "a , b ; c\t\r\n  ~", "12+7="):
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text)  # one token per character, no BOS/EOS added
        assert tok.decode(ids) == text
    assert tok.pad_token_id == 0
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert tok.decode(tok("19")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "19"


def test_same_seed_same_weights(model_dir, tmp_path):
    again = load_file(build_model(tmp_path / "again", seed=3) / "model.safetensors")
    other = load_file(build_model(tmp_path / "other", seed=4) / "model.safetensors")
    first = load_file(model_dir / "model.safetensors")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_bpe_tokenizer_and_bf16(tmp_path):
    corpus = [f"{a}+{b}={a + b} sort {a % 10} {b % 10}: odd even" for a in range(60) for b in range(60)]
    tok = build_tokenizer("bpe", corpus=corpus, vocab_size=400)
    assert len(tok) <= 400 and tok.pad_token_id == 0 and tok.eos_token_id != tok.pad_token_id
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT
    out = build_model(tmp_path / "bf16", dtype="bfloat16", intermediate=96, kv_heads=2)
    assert next(iter(load_file(out / "model.safetensors").values())).dtype == torch.bfloat16
    assert count_params(out) > 0


def test_param_counts_match_comments():
    assert tiny.preset_params("tiny") == 139_584
    assert tiny.preset_params("0.5b") == 492_094_464
    assert tiny.preset_params("0.5b-gqa") == 490_521_600  # the comment in PRESETS
    assert tiny.preset_params("1.5b") == 1_469_535_744


def test_bad_sizes_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="hidden=64 is not divisible by heads=5"):
        build_model(tmp_path / "x", heads=5)
    with pytest.raises(ValueError, match="kind='word'"):
        build_tokenizer("word")


def test_cli_run_uses_preset_and_overrides(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    make.add_arguments(parser)
    args = parser.parse_args([str(tmp_path / "cli"), "--layers", "1", "--hidden", "32"])
    assert make.run(args) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (1, 32)


def test_cli_run_reports_bad_sizes_as_user_error(tmp_path):
    import argparse

    from xrlhf.utils.errors import UserError

    parser = argparse.ArgumentParser()
    make.add_arguments(parser)
    with pytest.raises(UserError, match="make-tiny-model: build_model: heads=4 is not divisible by kv_heads=3"):
        make.run(parser.parse_args([str(tmp_path / "bad"), "--kv-heads", "3"]))


# Built at commit f2ec57c (before the tiny chat template) with torch 2.13.0+cpu:
# sha256 of model.safetensors of build_model(dir, **PRESETS["tiny"]), i.e. artifacts/tiny-char.
TINY_WEIGHTS_SHA256 = "e85028aa475866d9e414bdf0f65fa84c04e74800bb2611722138c8df442ce22d"
TINY_WEIGHTS_TORCH = "2.13."
CHAR_IDS = {"12+7=19\nodd": [5, 6, 76, 11, 84, 5, 13, 100, 28, 17, 17],
            "Hello, world! ~\t\r": [47, 18, 25, 25, 28, 77, 98, 36, 28, 31, 25, 17, 66, 98, 97, 99, 101],
            "<s>a</s>": [1, 14, 2]}


def test_chat_template_saved_and_nothing_else_changed(tmp_path):
    import hashlib

    out = build_model(tmp_path / "tiny-char", **tiny.PRESETS["tiny"])
    tok = AutoTokenizer.from_pretrained(out)
    assert (out / "chat_template.jinja").read_text() == tok.chat_template == tiny.CHAT_TEMPLATE
    for text, ids in CHAR_IDS.items():  # the ids of main before the template
        assert tok(text)["input_ids"] == ids
    assert len(tok) == 102
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "5"}, {"role": "tool", "content": "ok"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        "<s>S: Be brief.\nU: 2+3?\nA:\n5</s>\nT: ok\nA:\n"
    if not torch.__version__.startswith(TINY_WEIGHTS_TORCH):
        pytest.skip(f"weights digest recorded with torch {TINY_WEIGHTS_TORCH}x, not {torch.__version__}")
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == TINY_WEIGHTS_SHA256
