"""ChatFormat: token-in/token-out conversations equal the chat template applied to the whole."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from xrlhf.data.chat import ChatFormat
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.envs.base import Prompt
from xrlhf.models.tiny import build_model, build_tokenizer, default_corpus

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12+7?"},
    {"role": "assistant", "content": "<tool_call>calc: 12+7</tool_call>"},
    {"role": "tool", "content": "19"},
    {"role": "assistant", "content": "It is 19."},
    {"role": "user", "content": "Sure? Check (again)."},
    {"role": "assistant", "content": "Yes: 19"},
]

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""A ChatML template (Qwen's layout): the end-of-turn token differs from EOS and also ends user turns."""

DROPS_THINK = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set c = m['content'] %}{% if not loop.last and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}{{ 'A: ' + c + '</s>' }}"
    "{% else %}{{ m['role'][0] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}")
"""Drops the <think> block of every assistant message but the last, as Qwen3's template does."""

COUNTER = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ 'S(' + messages|length|string + '): ' + m['content'] + '\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'A: ' + m['content'] + '</s>' }}"
    "{% else %}{{ 'U: ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}")
"""Writes the number of messages into the system prompt, like a date that changes."""


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("chat") / "char", layers=1, hidden=16, heads=2)


@pytest.fixture(scope="module")
def char_tok(char_dir):
    return load_tokenizer(str(char_dir))


@pytest.fixture(scope="module")
def bpe_tok():
    return build_tokenizer("bpe", corpus=default_corpus(2000), vocab_size=600)


@pytest.fixture(scope="module")
def chatml_tok():
    tok = build_tokenizer("bpe", corpus=default_corpus(2000), vocab_size=600)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = CHATML
    return tok


def _with_template(template: str):
    tok = build_tokenizer("char")
    tok.chat_template = template
    return tok


def _whole(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


@pytest.mark.parametrize("which", ["char_tok", "bpe_tok", "chatml_tok"])
def test_token_in_out_equals_whole_conversation(which, request):
    tok = request.getfixturevalue(which)
    chat = ChatFormat(tok)
    assert chat.prefix_stable and chat.stability_issue is None
    traj = chat.prompt_ids(CONV[:2])
    for i, m in enumerate(CONV[2:], start=2):
        if m["role"] == "assistant":
            assert traj == _whole(tok, CONV[:i], add_generation_prompt=True)  # the turn's context
            traj = traj + chat.assistant_ids(m["content"])
        else:
            traj = traj + chat.observation_ids(m)
    assert traj + chat.tail_ids == _whole(tok, CONV)
    assert traj[-1] == chat.stop_ids[0]


def test_stop_ids_and_tail_from_the_template(char_tok, chatml_tok):
    chat = ChatFormat(char_tok)
    assert chat.stop_ids == [char_tok.eos_token_id]
    assert chat.end_of_turn == char_tok.convert_tokens_to_ids("</s>")
    assert char_tok.decode(chat.tail_ids) == "\n"
    chatml = ChatFormat(chatml_tok)
    assert chatml.stop_ids == [chatml_tok.convert_tokens_to_ids("<|im_end|>"), chatml_tok.eos_token_id]
    assert chatml_tok.decode(chatml.tail_ids) == "\n"


def test_observation_ids_for_user_and_tool(char_tok, chatml_tok):
    chat = ChatFormat(char_tok)
    user = chat.observation_ids({"role": "user", "content": "Try again."})
    assert char_tok.decode(user) == "\nU: Try again.\nA:\n"
    assert char_tok.decode(chat.observation_ids({"role": "tool", "content": "19"})) == "\nT: 19\nA:\n"
    two = chat.observation_ids([{"role": "tool", "content": "19"}, {"role": "user", "content": "ok"}])
    assert char_tok.decode(two) == "\nT: 19\nU: ok\nA:\n"
    chatml = ChatFormat(chatml_tok)
    assert chatml_tok.decode(chatml.observation_ids({"role": "tool", "content": "19"})) == \
        "\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n"


def test_control_tokens_in_an_observation_are_text(char_tok):
    chat = ChatFormat(char_tok)
    ids = chat.observation_ids({"role": "tool", "content": "x</s>\nA:\n<s>"})
    assert char_tok.eos_token_id not in ids and char_tok.bos_token_id not in ids
    assert char_tok.decode(ids) == "\nT: x</s>\nA:\n<s>\nA:\n"


def test_unknown_role_is_named(char_tok):
    with pytest.raises(ValueError, match=r"cannot render roles \['user', 'assistant', 'critic'\]"):
        ChatFormat(char_tok).observation_ids({"role": "critic", "content": "no"})


def test_no_template_is_one_line(tmp_path):
    tok = build_tokenizer("char")
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template") as e:
        ChatFormat(tok, model_dir=str(tmp_path / "m"))
    assert "\n" not in str(e.value) and str(tmp_path / "m/chat_template.jinja") in str(e.value)


def test_template_that_drops_earlier_thinking_is_flagged():
    chat = ChatFormat(_with_template(DROPS_THINK))
    assert not chat.prefix_stable
    assert "not prefix-stable" in chat.stability_issue and "message 2 (assistant)" in chat.stability_issue
    with pytest.raises(ValueError, match=r"not prefix-stable.*message 2 \(assistant\)"):
        ChatFormat(_with_template(DROPS_THINK), strict=True)


def test_template_with_a_counter_in_the_system_prompt_is_flagged():
    chat = ChatFormat(_with_template(COUNTER))
    assert not chat.prefix_stable and "message 0 (system)" in chat.stability_issue
    # token in/out still works: the trajectory keeps what the model saw while sampling
    traj = chat.prompt_ids(CONV[:2]) + chat.assistant_ids("x")
    assert chat.tokenizer.decode(traj) == "S(2): Be brief.\nU: What is 12+7?\nA: x</s>"


def test_encode_conversation_masks_assistant_tokens(char_tok, bpe_tok):
    for tok in (char_tok, bpe_tok):
        chat = ChatFormat(tok)
        ids, mask = chat.encode_conversation(CONV)
        assert len(ids) == len(mask) and ids + chat.tail_ids == _whole(tok, CONV)
        taught = [i for i, m in zip(ids, mask) if m]
        want = [t for m in CONV if m["role"] == "assistant" for t in chat.assistant_ids(m["content"])]
        assert taught == want
    chat = ChatFormat(char_tok)
    ids, mask = chat.encode_conversation(CONV[:4])  # ends with an observation: its generation prompt
    assert char_tok.decode(ids).endswith("\nT: 19\nA:\n") and mask[-1] == 0
    with pytest.raises(ValueError, match="must start with a non-assistant"):
        chat.encode_conversation(CONV[2:])
    with pytest.raises(ValueError, match="two assistant messages in a row"):
        chat.encode_conversation([*CONV[:3], CONV[2]])


def test_encode_prompt_takes_text_or_messages(char_tok):
    text_ids = char_tok.encode("12+7=", add_special_tokens=False)
    assert encode_prompt(char_tok, "12+7=") == [char_tok.bos_token_id, *text_ids]
    plain = Prompt(text="12+7=", answer="19")
    chat = Prompt(text="What is 12+7?", answer="19", messages=tuple(CONV[:2]))
    assert encode_prompt(char_tok, plain) == encode_prompt(char_tok, "12+7=")
    assert encode_prompt(char_tok, chat) == _whole(char_tok, CONV[:2], add_generation_prompt=True)
    assert len({chat, plain, Prompt(text="What is 12+7?", answer="19", messages=tuple(CONV[:2]))}) == 2


def test_format_is_cached_per_tokenizer(char_tok):
    first = ChatFormat(char_tok)
    assert ChatFormat(char_tok)._a is first._a
    tok = _with_template(COUNTER)
    counted = ChatFormat(tok)
    tok.chat_template = DROPS_THINK  # a new template is analysed again
    assert ChatFormat(tok)._a is not counted._a and "message 2" in ChatFormat(tok).stability_issue


def test_a_role_the_template_skips_is_named():
    tok = _with_template("{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['role'][0] + ': ' + "
                         "m['content'] + ('</s>' if m['role'] == 'assistant' else '\\n') }}{% endif %}"
                         "{% endfor %}{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}")
    chat = ChatFormat(tok)
    assert chat.prefix_stable  # the probe without a tool message passes
    assert tok.decode(chat.observation_ids({"role": "user", "content": "hi"})) == "u: hi\na: "
    with pytest.raises(ValueError, match="drops 'tool' messages"):
        chat.observation_ids({"role": "tool", "content": "19"})
