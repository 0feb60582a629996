"""Tools: small programs the policy calls in the middle of an episode.

A tool is a class with a name, a one-line description the model reads in its system prompt, and
its own validated options (a pydantic ``Config`` on the class, STYLE principle 12). The episode
env parses a call out of the model's turn (``xrlhf.tools.format``), runs it with
:func:`call_tool` and turns the :class:`ToolResult` into an observation.

**A tool never raises into the run, nor hangs it.** A model writes arbitrary arguments; a crash,
a timeout or a bad argument is an *observation* for the model to learn from, not a failed training
step. :func:`call_tool` is the one place that guarantees it: any exception becomes
``ToolResult("error: ...", error=True)``, a call past ``timeout_s`` becomes ``error: timed out``
(``timed_out=True``), and every output is capped.

**Where a call runs** is the tool's ``sandbox`` option. A user's own tool runs by default in a
sandboxed worker process (``xrlhf.tools.sandbox``: no writes outside its work dir, no network,
killed at its timeout), as the ``python`` tool's programs do; ``sandbox: none`` runs a trusted
tool in the trainer's process, where a call past its timeout is abandoned (``utils.bounded``).

**Adding a tool means adding a file** (principle 15): ``TOOLS`` finds ``xrlhf/tools/<name>.py``
when ``<name>`` is asked for, and a user's tool anywhere is named by import path
``pkg.module:Class``. Nothing here lists the tools by name.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from xrlhf.utils.bounded import UserCodeTimeout, call_bounded, running_calls
from xrlhf.utils.registry import Registry

TOOLS: Registry[type] = Registry("tool", package="xrlhf.tools", skip=("base", "build", "format", "sandbox"))
"""Tool classes by name, found by file: ``calculator`` lives in ``xrlhf/tools/calculator.py``."""

MAX_ABANDONED = 8
"""In-process calls of one tool still running past their timeout after which the tool is not
called again until one ends (each holds a thread: a tool that always hangs must not pile them up)."""

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
"""What a tool name may look like: it is written by the model inside a call (no spaces, no ':')."""


def register_tool(name: str):
    """Class decorator: ``@register_tool("name")`` adds a :class:`Tool` subclass to ``TOOLS`` and
    sets its ``name`` (the name the model calls it by).

    Raises:
        ValueError: for a name the call format cannot carry, a class whose own ``name`` differs,
            or a name already registered to another class.
    """
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"tool name {name!r} must match {NAME_PATTERN.pattern} (the model writes it in a call)")

    def deco(cls: type) -> type:
        own = cls.__dict__.get("name", "")
        if own and own != name:
            raise ValueError(f"tool class {cls.__name__} has name {own!r} but is registered as {name!r}")
        cls.name = name
        return TOOLS.register(name)(cls)

    return deco


@dataclass
class ToolResult:
    """What a tool call gave back.

    Attributes:
        output: the text the model sees (an error's text starts with ``"error: "``).
        error: the call failed (bad arguments, an exception, a timeout, a non-zero exit).
        seconds: wall time of the call (set by :func:`call_tool`).
        timed_out: the call ran past the tool's ``timeout_s`` (``error`` is set too).
    """

    output: str
    error: bool = False
    seconds: float = 0.0
    timed_out: bool = False


Sandbox = Literal["auto", "namespaces", "process", "none"]
"""Where a tool's calls run (``ToolOptions.sandbox``; docs/tools.md says what each guarantees)."""


class ToolOptions(BaseModel):
    """Options every tool has; the base of every ``Tool.Config``. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit of one call, in seconds: a call past it "
                             "is an error observation (a sandboxed worker is killed, an in-process call abandoned)")
    max_output_chars: int = Field(1000, ge=16, description="longer outputs are cut to this many characters, "
                                  "keeping the start and the end")
    sandbox: Sandbox = Field("auto", description="where calls run: namespaces / process: a sandboxed worker "
                             "process (no writes outside its work dir, no network; namespaces: also a chroot and a "
                             "fresh uid, needs root); auto: namespaces where they work, else process; none: in the "
                             "trainer's process (trusted code; a call past timeout_s is abandoned, not stopped)")


class Tool(ABC):
    """A tool the model can call.

    Subclasses set ``description`` (one line, shown to the model), ``argument`` (the name of the
    tool's one argument in the JSON call format), optionally ``Config`` (a subclass of
    :class:`ToolOptions`), and implement :meth:`run`. A registered tool gets ``name`` from
    :func:`register_tool`; one chosen by import path sets ``name`` itself.

    Args:
        config: an instance of ``Config`` (``None``: all defaults).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    argument: ClassVar[str] = "input"
    Config: ClassVar[type[ToolOptions]] = ToolOptions
    enforces_timeout: ClassVar[bool] = False
    """The tool stops its own calls at ``timeout_s`` (``python``, a sandboxed tool), so
    :func:`call_tool` calls it directly instead of through a watchdog thread."""

    def __init__(self, config: ToolOptions | None = None):
        if config is None:
            config = self.Config()
        if not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__}: config is a {type(config).__name__}, "
                            f"expected {self.Config.__name__}")
        self.config = config

    @abstractmethod
    def run(self, arguments: str | dict[str, Any]) -> ToolResult:
        """Run one call. ``arguments`` is the compact format's string or the JSON format's object.

        May raise on bad input: :func:`call_tool` turns any exception into an error result.
        """

    def text_argument(self, arguments: str | dict[str, Any]) -> str:
        """The tool's one argument as text: ``arguments`` itself, or its ``argument`` key.

        Raises:
            ValueError: if a JSON call lacks the key or its value is not a string.
        """
        if isinstance(arguments, str):
            return arguments
        value = arguments.get(self.argument) if isinstance(arguments, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"{self.name} takes one string argument {self.argument!r}, got {arguments!r}")
        return value


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters with a marker, keeping the start and the end
    (an error's last line, a program's final answer)."""
    if len(text) <= limit:
        return text
    marker = f"\n...[cut: {len(text)} chars in all]...\n"
    keep = limit - len(marker)
    if keep <= 0:
        return text[:limit]
    head = keep * 2 // 3
    return text[:head] + marker + text[len(text) - (keep - head):]


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line (newlines become ``" | "``), cut to ``limit`` characters."""
    text = " | ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_tool(tool: Tool, arguments: str | dict[str, Any]) -> ToolResult:
    """Run ``tool`` on ``arguments`` within its ``timeout_s``; never raises (but
    ``KeyboardInterrupt`` passes, and ``UserCodeAborted`` once the run is stopping:
    ``utils.bounded.STOPPING``) and never waits past the timeout.

    A tool that does not enforce its timeout itself (``Tool.enforces_timeout``) runs in a
    watchdog thread (``utils.bounded.call_bounded``): past ``timeout_s`` the call is abandoned and
    the result is ``error: timed out ...`` with ``timed_out=True`` (and while :data:`MAX_ABANDONED`
    such calls of the tool still run, it is not called at all). An exception (``SystemExit``
    included) becomes ``ToolResult("error: <type>: <message>", error=True)``; the output is cut
    to ``tool.config.max_output_chars`` (:func:`truncate`); ``seconds`` is the wall time.
    """
    start = time.monotonic()
    config = getattr(tool, "config", None) or ToolOptions()
    what = f"tool {tool.name!r}"
    if tool.enforces_timeout:
        result = run_tool(tool, arguments)
    elif sum(c.abandoned and c.what == what for c in running_calls()) >= MAX_ABANDONED:
        result = ToolResult(f"error: not called: {MAX_ABANDONED} earlier calls of tool {tool.name!r} are still running "
                            f"past their timeout", error=True)
    else:
        try:
            result = call_bounded(lambda: run_tool(tool, arguments), config.timeout_s, what)
        except UserCodeTimeout:
            result = ToolResult(f"error: timed out after {config.timeout_s:g} s (the call was abandoned)",
                                error=True, timed_out=True)
    result.output = truncate(str(result.output), config.max_output_chars)
    result.seconds = time.monotonic() - start
    return result


def run_tool(tool: Tool, arguments: str | dict[str, Any]) -> ToolResult:
    """``tool.run(arguments)`` with any exception or a result of the wrong type as an error
    result: what :func:`call_tool` and a sandbox worker call, without a time limit or a cap."""
    try:
        result = tool.run(arguments)
        if not isinstance(result, ToolResult):
            result = ToolResult(f"error: tool {tool.name!r} returned {type(result).__name__}, not a ToolResult",
                                error=True)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a tool's failure is an observation, not the run's
        result = ToolResult(f"error: {type(e).__name__}: {one_line(e)}", error=True)
    return result


def tool_class(name: str) -> type[Tool]:
    """The :class:`Tool` subclass ``name`` (registered name or ``pkg.module:Class``).

    Raises:
        KeyError: for an unknown name, listing the valid ones.
        TypeError: if ``name`` resolves to something that is not a named ``Tool`` subclass.
    """
    cls = TOOLS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise TypeError(f"tool {name!r} is {cls!r}, not a subclass of xrlhf.tools.Tool")
    if not NAME_PATTERN.fullmatch(cls.name or ""):
        raise TypeError(f"tool class {cls.__name__} has no valid name; set the class attribute "
                        f"name (matching {NAME_PATTERN.pattern})")
    return cls
