"""Episodes in which the model may call tools before it answers.

The turn protocol every tool env shares (``ToolUseEpisode``): the model's turn is either a tool
call in the env's format (``xrlhf.tools.format``: ``<tool_call>calculator: 12*34</tool_call>``)
or a final answer. A call is run (``xrlhf.tools.base.call_tool``: never raises, never waits past
the tool's ``timeout_s``; errors and timeouts come back as text) and its output is the next
observation, a ``tool`` message; a malformed call or an unknown tool is an observation too
("error: ..."), so the model can try again within ``max_turns``. A final answer ends the episode
and is judged by the env. A call that timed out is also a warning in the log naming the env, the
tool and the prompt: a tool that hangs shows, instead of only slowing the run down.

Counters per turn (episode metrics): ``tool_calls``, ``tool_errors``, ``tool_timeouts``.

``ToolSpec`` (``xrlhf.tools.base``) is how YAML names a tool (``{name, options}``); ``ToolEnvOptions`` validates
a list of them when the config is loaded, so a bad name or option is a config error, before anything
starts.
"""

from __future__ import annotations

from typing import Callable, Literal

from loguru import logger
from pydantic import Field, model_validator

from xrlhf.envs.episode import Episode, EpisodeOptions, Message, Turn
from xrlhf.tools.base import Tool, ToolResult, call_tool
from xrlhf.tools.build import ToolSpec, build_tool, tool_errors
from xrlhf.tools.format import ToolCallError, parse_tool_call, tool_prompt


class ToolEnvOptions(EpisodeOptions):
    """Options of an env whose episodes may call tools."""

    tools: list[ToolSpec] = Field(default_factory=list, description="the tools offered ([]: none)")
    tool_format: Literal["compact", "json"] = Field("compact", description="how a turn calls a tool "
                                                    "(docs/tools.md)")
    system_prompt: bool = Field(False, description="begin with a system message listing the tools and "
                                "the call format (a model that has not been warmed up on the env)")

    @model_validator(mode="after")
    def _tools_valid(self) -> "ToolEnvOptions":
        errors = tool_errors([t.model_dump() for t in self.tools], "env.options.tools", self.step_timeout_s)
        if errors:  # a cross-field check: each line names its own YAML path
            raise ValueError("\n".join(errors))
        return self

    def build_tools(self) -> dict[str, Tool]:
        """The tools by the name the model calls them (each tool's ``name``). A sandboxed tool
        starts its worker at its first call (``xrlhf validate`` starts each once, to show an
        import or constructor error before a run)."""
        tools = [build_tool(t.name, t.options) for t in self.tools]
        return {tool.name: tool for tool in tools}


TOOL_COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts")
"""The counters every turn of a :class:`ToolUseEpisode` sets (an env's ``counters``)."""


def first_messages(options: ToolEnvOptions, tools: dict[str, Tool], user: str) -> tuple[Message, ...]:
    """The messages an episode starts with: the system prompt listing the tools and the call
    format when ``options.system_prompt`` is on (and there are tools), then ``user``. An env
    builds its prompts' ``messages`` with it; ``system_prompt`` does nothing in an env that does not."""
    system = ({"role": "system", "content": tool_prompt(list(tools.values()), options.tool_format)},) \
        if options.system_prompt and tools else ()
    return (*system, {"role": "user", "content": user})


class ToolUseEpisode(Episode):
    """One episode of the tool protocol (module docstring).

    Args:
        tools: the tools by name.
        fmt: the call format.
        judge: final answer text -> ``(reward, correct)``.
        where: the env and the prompt, for the log line of a timed-out call
            (``"env CalcEnv, prompt '482*917='"``).
    """

    def __init__(self, tools: dict[str, Tool], fmt: str, judge: Callable[[str], tuple[float, bool]],
                 where: str = "an episode"):
        self.tools, self.fmt, self.judge, self.where = tools, fmt, judge, where

    def step(self, action: str) -> Turn:
        try:
            call = parse_tool_call(action, self.fmt) if self.tools else None
        except ToolCallError as e:
            return _tool_turn(ToolResult(f"error: {e}", error=True))
        if call is None:
            reward, correct = self.judge(action)
            return Turn(reward=reward, done=True, correct=correct, info=dict.fromkeys(TOOL_COUNTERS, 0.0))
        tool = self.tools.get(call.name)
        if tool is None:
            return _tool_turn(ToolResult(f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}",
                                         error=True))
        result = call_tool(tool, call.arguments)
        if result.timed_out:
            logger.warning(f"{self.where}: tool {call.name!r} timed out after {tool.config.timeout_s:g} s on "
                           f"{str(call.arguments)[:80]!r}; the model sees an error (tool_timeouts counts them: "
                           f"raise the tool's timeout_s, or fix the tool)")
        return _tool_turn(result)


def _tool_turn(result: ToolResult) -> Turn:
    return Turn(observation={"role": "tool", "content": result.output},
                info={"tool_calls": 1.0, "tool_errors": float(result.error), "tool_timeouts": float(result.timed_out)})
