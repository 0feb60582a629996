"""The tool-call format: how a model's turn asks for a tool, and how we write one for it.

A turn calls a tool by containing one tagged call; the env answers with the tool's output as the
next message. Two formats (docs/tools.md):

* ``"compact"``: ``<tool_call>NAME: ARGUMENTS</tool_call>``, one string argument (stripped).
  Short, so a tiny character-level model can learn it from a few warm-up examples.
* ``"json"``: ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, the Hermes / Qwen
  style that instruction-tuned models already write.

**Only the first call of a turn counts**: text after its closing tag, further calls included, is
ignored. A turn without ``<tool_call>`` is an ordinary answer (:func:`parse_tool_call` returns
``None``); a turn with a broken call (no closing tag, no name, bad JSON) raises
:class:`ToolCallError`, whose one-line message the env can show the model.

:func:`format_tool_call` is the inverse (supervised warm-up examples are built with it), and
:func:`tool_prompt` writes the system-prompt text that lists the tools and the format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

CallFormat = Literal["compact", "json"]
FORMATS: tuple[str, ...] = ("compact", "json")


class ToolCallError(ValueError):
    """A malformed tool call; the message is one line, fit to show the model."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a string, or the JSON format's object)."""

    name: str
    arguments: str | dict[str, Any]


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; valid: {', '.join(FORMATS)}")


def parse_tool_call(text: str, fmt: CallFormat = "compact") -> ToolCall | None:
    """The first tool call in ``text``, or ``None`` if there is none.

    Args:
        text: the model's turn (decoded, stop token removed).
        fmt: ``"compact"`` or ``"json"``.

    Raises:
        ToolCallError: the first ``<tool_call>`` is malformed (unclosed, empty name, bad JSON).
        ValueError: for an unknown ``fmt``.
    """
    _check_format(fmt)
    start = text.find(OPEN)
    if start < 0:
        return None
    end = text.find(CLOSE, start + len(OPEN))
    if end < 0:
        raise ToolCallError(f"unclosed {OPEN}: end the call with {CLOSE}")
    body = text[start + len(OPEN):end]
    return _parse_compact(body) if fmt == "compact" else _parse_json(body)


def _parse_compact(body: str) -> ToolCall:
    name, colon, arguments = body.partition(":")
    name = name.strip()
    if not colon:
        raise ToolCallError(f"no ':' in the tool call; write {OPEN}NAME: ARGUMENTS{CLOSE}")
    if not name:
        raise ToolCallError(f"empty tool name; write {OPEN}NAME: ARGUMENTS{CLOSE}")
    if any(c.isspace() for c in name):
        raise ToolCallError(f"tool name {name[:40]!r} contains spaces; write {OPEN}NAME: ARGUMENTS{CLOSE}")
    return ToolCall(name, arguments.strip())


def _parse_json(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"tool call is not valid JSON ({e.msg} at char {e.pos}); write "
                            f'{OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}') from None
    if not isinstance(obj, dict):
        raise ToolCallError(f'tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                            f"got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError('tool call has no "name" (a non-empty string)')
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, (dict, str)):
        raise ToolCallError(f'tool call "arguments" must be an object or a string, got {type(arguments).__name__}')
    return ToolCall(name.strip(), arguments)


def format_tool_call(call: ToolCall, fmt: CallFormat = "compact") -> str:
    """The text of ``call`` in ``fmt``; ``parse_tool_call(format_tool_call(c, fmt), fmt) == c``
    for a call whose compact arguments carry no surrounding whitespace.

    Raises:
        ValueError: for an unknown ``fmt``, a name the format cannot carry, or compact arguments
            that are not a string or contain the closing tag.
    """
    _check_format(fmt)
    if not call.name or any(c.isspace() for c in call.name) or ":" in call.name:
        raise ValueError(f"tool name {call.name!r} cannot be written in a call (empty, spaces or ':')")
    if fmt == "json":
        return f"{OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}{CLOSE}"
    if not isinstance(call.arguments, str):
        raise ValueError(f"the compact format takes one string argument, got {call.arguments!r}")
    if CLOSE in call.arguments:
        raise ValueError(f"arguments may not contain {CLOSE}")
    return f"{OPEN}{call.name}: {call.arguments}{CLOSE}"


def tool_prompt(tools: Iterable[Any], fmt: CallFormat = "compact") -> str:
    """A short system-prompt text: how to call a tool in ``fmt`` and one line per tool.

    Args:
        tools: :class:`xrlhf.tools.Tool` instances or classes (their ``name``, ``description``
            and ``argument`` are read).
    """
    _check_format(fmt)
    if fmt == "compact":
        how = f"To use a tool, write {OPEN}NAME: ARGUMENTS{CLOSE}."
        lines = [f"- {t.name}: {t.description}" for t in tools]
    else:
        how = f'To use a tool, write {OPEN}{{"name": NAME, "arguments": {{...}}}}{CLOSE}.'
        lines = [f'- {t.name} (arguments {{"{t.argument}": "..."}}): {t.description}' for t in tools]
    return "\n".join([how + " Its output comes back in the next message. One call per turn.",
                      "Tools:", *lines])
