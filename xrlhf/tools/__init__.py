"""Tools the policy calls during an episode: the base class and registry, the call format.

Each tool lives in its own file (``calculator.py``, ``python.py``) and is imported only when named
(``build_tool("python")``) or when every name is listed. See docs/tools.md.
"""

from xrlhf.tools.base import TOOLS, Tool, ToolOptions, ToolResult, call_tool, register_tool
from xrlhf.tools.build import ToolSpec, build_tool, tool_errors
from xrlhf.tools.format import CallFormat, ToolCall, ToolCallError, format_tool_call, parse_tool_call, tool_prompt

__all__ = ["TOOLS", "CallFormat", "Tool", "ToolCall", "ToolCallError", "ToolOptions", "ToolResult", "ToolSpec",
           "build_tool", "call_tool", "format_tool_call", "parse_tool_call", "register_tool", "tool_errors",
           "tool_prompt"]
