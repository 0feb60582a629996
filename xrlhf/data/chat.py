"""Chat templates as token ids: the prompt, the end-of-turn ids and each observation's ids.

A multi-turn episode is kept **token in / token out**: the model's sampled ids go into the
trajectory as sampled, and what the env says between turns is appended as the ids the chat
template renders for it, so the policy trains on exactly the tokens it sampled.
:class:`ChatFormat` derives those ids from the tokenizer's own chat template (the suffix a fixed
anchor conversation gains when the message is added). That equals re-rendering the whole
conversation only where the template is prefix-stable; ChatFormat checks this once per tokenizer
and warns where it is not (``prefix_stable``). An observation's text is encoded as characters,
never as control tokens, so an env cannot end a turn by what it prints. Which templates are not
prefix-stable, and what xrlhf does then: docs/chat.md.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from jinja2.exceptions import TemplateError
from loguru import logger

Message = Mapping[str, Any]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``."""

MARKER = "Zq7"
"""The anchor assistant's content, searched for in the rendered text to find what follows it."""

ROLE_MARKER = "Qz9"
"""The content of a probe message of each observation role: a template that renders the role
shows it (some templates silently skip roles they do not know)."""

ANCHOR: tuple[dict[str, str], ...] = ({"role": "user", "content": "1"},
                                      {"role": "assistant", "content": MARKER})
"""The conversation observations are rendered after: their ids are the suffix it gains."""

_THINK = "<think>\nr\n</think>\n\n"
PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
     {"role": "assistant", "content": _THINK + "<tool_call>calc: 2+3</tool_call>"},
     {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"},
     {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": _THINK + "Yes."}),
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
     {"role": "assistant", "content": _THINK + "5"}, {"role": "user", "content": "Sure?"},
     {"role": "assistant", "content": "Yes."}),
    ({"role": "user", "content": "2+3?"}, {"role": "assistant", "content": _THINK + "5"},
     {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}),
)
"""Conversations the prefix-stability check renders whole and turn by turn: the first one the
template accepts (templates without a ``tool`` or ``system`` role reject the longer ones). The
``<think>`` blocks catch templates that drop earlier reasoning."""


@dataclass(frozen=True)
class _Analysis:
    """What ChatFormat learns from a template once (cached per tokenizer)."""

    template: Any
    stop_ids: tuple[int, ...]
    anchor_stops: int  # end-of-turn tokens in ANCHOR rendered, up to the assistant's (the last)
    tail_ids: tuple[int, ...]
    prefix_stable: bool
    stability_issue: str | None


_CACHE: "weakref.WeakKeyDictionary[Any, _Analysis]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class ChatFormat:
    """The chat template of ``tokenizer`` as token ids, for token-in/token-out episodes.

    Cheap to make again: the analysis of a template (stop ids, anchor, prefix-stability) is
    cached per tokenizer object (``xrlhf.data.text.load_tokenizer`` caches those per model dir)
    and redone only if its ``chat_template`` changes.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        model_dir: where the tokenizer came from, for error messages (default: its
            ``name_or_path``).
        strict: raise ``ValueError`` for a template that is not prefix-stable, instead of
            warning and setting ``prefix_stable = False``.

    Attributes:
        stop_ids: ``list[int]``, the ids a turn stops at. ``stop_ids[0]`` is the template's
            end-of-turn token (the one :meth:`assistant_ids` appends and :meth:`observation_ids`
            follows); the tokenizer's EOS comes second when it differs (a model may end a turn
            with it; the trajectory then keeps it as sampled).
        tail_ids: ``list[int]``, what the template renders after the last assistant turn's
            end-of-turn token when the conversation ends there (``[]`` for most templates, the
            ``"\\n"`` of the tiny one); a trajectory ends at the stop token, without it.
        prefix_stable: whether turn-by-turn rendering equals whole-conversation rendering on
            the probe conversation.
        stability_issue: ``None``, or one line naming where the two renderings differ.

    Raises:
        ValueError: one line naming ``model_dir``, if the tokenizer has no chat template, if an
            assistant turn does not end in a special token, or (``strict``) if the template is
            not prefix-stable.
    """

    def __init__(self, tokenizer, model_dir: str | None = None, strict: bool = False):
        self.tokenizer = tokenizer
        self.where = str(model_dir or getattr(tokenizer, "name_or_path", "") or "this tokenizer")
        self._roles_seen: set[str] = set()  # observation roles the template is known to render
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                f"ChatFormat: the tokenizer of {self.where} has no chat template, which prompts with "
                f"messages need; use a chat/instruct model, or write {self.where}/chat_template.jinja "
                f"(xrlhf make-tiny-model writes the tiny template)")
        params = inspect.signature(tokenizer.apply_chat_template).parameters
        self._sanitize = {"sanitize_control_tokens": True} if "sanitize_control_tokens" in params else {}
        with _LOCK:
            analysis = _CACHE.get(tokenizer)
            if analysis is None or analysis.template != template:
                analysis = self._analyse(template)
                _CACHE[tokenizer] = analysis
        self._a = analysis
        self.stop_ids: list[int] = list(analysis.stop_ids)
        self.tail_ids: list[int] = list(analysis.tail_ids)
        self.prefix_stable: bool = analysis.prefix_stable
        self.stability_issue: str | None = analysis.stability_issue
        if strict and not self.prefix_stable:
            raise ValueError(f"ChatFormat: {self.stability_issue}")

    @property
    def end_of_turn(self) -> int:
        """The template's end-of-turn id (``stop_ids[0]``)."""
        return self._a.stop_ids[0]

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False,
               sanitize: bool = False) -> list[int]:
        """``apply_chat_template(messages)`` as a plain ``list[int]``.

        transformers 5 returns a ``BatchEncoding`` from ``tokenize=True`` unless
        ``return_dict=False``; this always gives the ids.

        Args:
            messages: the conversation.
            add_generation_prompt: end with the assistant's generation prompt.
            sanitize: encode control tokens inside the contents as text (where supported).

        Raises:
            ValueError: naming the model dir and the roles, if the template rejects the messages.
        """
        try:
            out = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False, **(self._sanitize if sanitize else {}))
        except TemplateError as e:
            roles = [m.get("role") for m in messages]
            raise ValueError(f"ChatFormat: the chat template of {self.where} cannot render roles "
                             f"{roles}: {e}") from None
        return _as_ids(out)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first context of an episode: ``messages`` rendered with the generation prompt.

        Args:
            messages: the conversation so far (``system`` / ``user`` / ...), not empty.

        Returns:
            ``list[int]`` of length P, ending in the assistant's generation prompt.
        """
        if not messages:
            raise ValueError("ChatFormat.prompt_ids: messages is empty")
        return self.render(messages, add_generation_prompt=True)

    def assistant_ids(self, content: str) -> list[int]:
        """An assistant turn as the model would sample it: ``content``'s ids + the end-of-turn id.

        Returns:
            ``list[int]`` of length ``len(tokens(content)) + 1``.
        """
        return [*self.tokenizer.encode(content, add_special_tokens=False), self.end_of_turn]

    def observation_ids(self, message: Message | Sequence[Message]) -> list[int]:
        """The ids that follow an assistant turn (which ends in ``end_of_turn``) to add ``message``.

        Whatever the template renders after the assistant's end-of-turn token, then the message
        (role ``user`` or ``tool``; a list for several in a row), then the next generation
        prompt: appended to a trajectory after a sampled turn, the trajectory equals the
        template applied to the whole conversation (for a prefix-stable template).

        Returns:
            ``list[int]`` of length O (loss mask 0 in a trajectory).

        Raises:
            ValueError: if the template rejects the role, or renders it without its content.
        """
        messages = [message] if isinstance(message, Mapping) else list(message)
        if not messages:
            raise ValueError("ChatFormat.observation_ids: no message")
        full = self.render([*ANCHOR, *messages], add_generation_prompt=True, sanitize=True)
        cut = _nth(full, self.end_of_turn, self._a.anchor_stops)
        if cut is None:
            raise ValueError(f"ChatFormat: the chat template of {self.where} renders the anchor "
                             f"conversation differently once a {messages[0].get('role')!r} message follows")
        for role in {str(m.get("role")) for m in messages} - self._roles_seen:
            self._check_role(role)
        return full[cut + 1:]

    def _check_role(self, role: str) -> None:
        """Raise ``ValueError`` if the template renders a ``role`` message without its content."""
        probe = [*ANCHOR, {"role": role, "content": ROLE_MARKER}]
        if ROLE_MARKER not in self.tokenizer.apply_chat_template(probe, tokenize=False):
            raise ValueError(f"ChatFormat: the chat template of {self.where} drops {role!r} messages "
                             f"(their content is not in the rendering)")
        self._roles_seen.add(role)

    def encode_conversation(self, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
        """A whole conversation tokenised turn by turn, as an episode's trajectory would be.

        ``prompt_ids`` of the messages before the first assistant message, then each assistant
        message's :meth:`assistant_ids` and each run of other messages' :meth:`observation_ids`
        (a conversation that ends with one ends with its generation prompt). For supervised
        warm-up of multi-turn episodes.

        Returns:
            ``(ids, loss_mask)``: two ``list[int]`` of length T; the mask is 1 on assistant
            tokens (content and end-of-turn id), 0 elsewhere.

        Raises:
            ValueError: if the conversation starts with an assistant message or has two in a row.
        """
        runs = _runs(messages)
        if not runs or runs[0][0] == "assistant":
            raise ValueError("ChatFormat.encode_conversation: the conversation must start with a "
                             "non-assistant message (system or user)")
        ids: list[int] = []
        mask: list[int] = []
        for i, (kind, run) in enumerate(runs):
            if kind == "assistant":
                if len(run) > 1:
                    raise ValueError("ChatFormat.encode_conversation: two assistant messages in a row")
                part, bit = self.assistant_ids(str(run[0].get("content") or "")), 1
            else:
                part, bit = (self.prompt_ids(run) if i == 0 else self.observation_ids(run)), 0
            ids += part
            mask += [bit] * len(part)
        return ids, mask

    def _analyse(self, template: Any) -> _Analysis:
        stop = self._end_of_turn()
        anchor = self.render(ANCHOR)
        k = len(anchor) - 1 - anchor[::-1].index(stop)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        stops = (stop,) if eos is None or eos == stop else (stop, int(eos))
        self._a = _Analysis(template, stops, anchor[:k + 1].count(stop),
                            tuple(anchor[k + 1:]), True, None)  # what the probe below needs
        issue = self._stability_issue()
        if issue:
            logger.warning(f"ChatFormat: {issue}")
        return replace(self._a, prefix_stable=issue is None, stability_issue=issue)

    def _end_of_turn(self) -> int:
        """The special token the template writes right after an assistant message's content."""
        try:
            text = self.tokenizer.apply_chat_template(list(ANCHOR), tokenize=False)
        except TemplateError as e:
            raise ValueError(f"ChatFormat: the chat template of {self.where} cannot render a user "
                             f"and an assistant message: {e}") from None
        at = text.rfind(MARKER)
        if at < 0:
            raise ValueError(f"ChatFormat: the chat template of {self.where} does not render an "
                             f"assistant message's content")
        rest = text[at + len(MARKER):]
        after = self.tokenizer.encode(rest, add_special_tokens=False)
        special = set(getattr(self.tokenizer, "all_special_ids", [])) | {
            i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if t.special}
        if not after or after[0] not in special:
            raise ValueError(f"ChatFormat: the chat template of {self.where} ends an assistant turn "
                             f"with {rest[:20]!r}, not a special token, so generation cannot stop "
                             f"at the end of a turn")
        return int(after[0])

    def _stability_issue(self) -> str | None:
        """``None`` if a probe conversation built turn by turn equals its whole rendering,
        else one line naming the first message where they differ."""
        error = None
        for probe in PROBES:
            try:
                whole = self.render(probe)
                ids, starts = self._turn_by_turn(probe)
            except ValueError as e:  # the template rejects or skips a role here: try a shorter probe
                error = e
                continue
            if ids == whole:
                return None
            diff = next((i for i, (a, b) in enumerate(zip(ids, whole)) if a != b),
                        min(len(ids), len(whole)))
            run_no = sum(1 for s in starts if s <= diff) - 1
            msg_no = sum(len(r) for _, r in _runs(probe)[:run_no])
            role = probe[min(msg_no, len(probe) - 1)]["role"]
            return (f"the chat template of {self.where} is not prefix-stable: the whole conversation "
                    f"renders differently from turn by turn at token {diff}, in message {msg_no} "
                    f"({role}) (e.g. a template that drops earlier <think> blocks, or a date or counter "
                    f"in the system prompt); trajectories keep the tokens as sampled and will not "
                    f"equal the re-rendered conversation")
        return f"the chat template of {self.where} renders no probe conversation turn by turn: {error}"

    def _turn_by_turn(self, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
        """``messages`` (ending with an assistant) built as a trajectory, plus the tail ids, and
        the position where each run of messages starts."""
        ids: list[int] = []
        starts: list[int] = []
        for kind, run in _runs(messages):
            starts.append(len(ids))
            ids += (self.assistant_ids(run[0]["content"]) if kind == "assistant" else
                    self.prompt_ids(run) if not ids else self.observation_ids(run))
        return ids + list(self._a.tail_ids), starts


def _runs(messages: Sequence[Message]) -> list[tuple[str, list[Message]]]:
    """``messages`` grouped into maximal runs: ``("assistant", [m])`` or ``("other", [m, ...])``."""
    runs: list[tuple[str, list[Message]]] = []
    for m in messages:
        kind = "assistant" if m.get("role") == "assistant" else "other"
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(m)
        else:
            runs.append((kind, [m]))
    return runs


def _nth(ids: list[int], token: int, n: int) -> int | None:
    """The position of the ``n``-th (1-based) occurrence of ``token`` in ``ids``, or ``None``."""
    seen = 0
    for i, t in enumerate(ids):
        if t == token:
            seen += 1
            if seen == n:
                return i
    return None


def _as_ids(out: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template`` returned (list, BatchEncoding, tensor)."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        (out,) = out
    return [int(i) for i in out]
