"""Episodes in which the model may call tools before it answers.

The turn protocol every tool env shares (``ToolUseEpisode``): the model's turn is either a tool
call in the env's format (``xrlhf.tools.format``: ``<tool_call>calculator: 12*34</tool_call>``)
or a final answer. A call is run (``xrlhf.tools.base.call_tool``: never raises; errors and
timeouts come back as text) and its output is the next observation, a ``tool`` message; a
malformed call or an unknown tool is an observation too ("error: ..."), so the model can try
again within ``max_turns``. A final answer ends the episode and is judged by the env.

Counters per turn (episode metrics): ``tool_calls``, ``tool_errors``.

``ToolSpec`` (``xrlhf.tools.base``) is how YAML names a tool (``{name, options}``); ``ToolEnvOptions`` validates
a list of them when the config is loaded, so a bad name or option is a config error, before anything
starts.
"""

from __future__ import annotations

from typing import Callable, Literal

from pydantic import Field, model_validator

from xrlhf.envs.episode import Episode, EpisodeOptions, Message, Turn
from xrlhf.tools.base import Tool, ToolSpec, build_tool, call_tool, tool_errors
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
        errors = tool_errors([t.model_dump() for t in self.tools], "env.options.tools")
        if errors:  # a cross-field check: each line names its own YAML path
            raise ValueError("\n".join(errors))
        return self

    def build_tools(self) -> dict[str, Tool]:
        """The tools by the name the model calls them (each tool's ``name``)."""
        tools = [build_tool(t.name, t.options) for t in self.tools]
        return {tool.name: tool for tool in tools}


def first_messages(options: ToolEnvOptions, tools: dict[str, Tool], user: str) -> tuple[Message, ...]:
    """The messages an episode starts with: the optional system prompt, then ``user``."""
    system = ({"role": "system", "content": tool_prompt(list(tools.values()), options.tool_format)},) \
        if options.system_prompt and tools else ()
    return (*system, {"role": "user", "content": user})


class ToolUseEpisode(Episode):
    """One episode of the tool protocol (module docstring).

    Args:
        tools: the tools by name.
        fmt: the call format.
        judge: final answer text -> ``(reward, correct)``.
    """

    def __init__(self, tools: dict[str, Tool], fmt: str, judge: Callable[[str], tuple[float, bool]]):
        self.tools, self.fmt, self.judge = tools, fmt, judge

    def step(self, action: str) -> Turn:
        try:
            call = parse_tool_call(action, self.fmt) if self.tools else None
        except ToolCallError as e:
            return _tool_turn(f"error: {e}", error=True)
        if call is None:
            reward, correct = self.judge(action)
            return Turn(reward=reward, done=True, correct=correct, info={"tool_calls": 0.0, "tool_errors": 0.0})
        tool = self.tools.get(call.name)
        if tool is None:
            return _tool_turn(f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}", error=True)
        result = call_tool(tool, call.arguments)
        return _tool_turn(result.output, error=result.error)


def _tool_turn(output: str, error: bool) -> Turn:
    return Turn(observation={"role": "tool", "content": output},
                info={"tool_calls": 1.0, "tool_errors": float(error)})
