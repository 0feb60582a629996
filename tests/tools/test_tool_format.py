"""The tool-call format: parse, write back, malformed calls, the system prompt."""

import pytest

from xrlhf.tools import ToolCall, ToolCallError, build_tool, format_tool_call, parse_tool_call, tool_prompt


@pytest.mark.parametrize("call", [ToolCall("calculator", "2*(3+4)"), ToolCall("python", "print(1)\nprint(2)"),
                                  ToolCall("a.b-c_d", "x: y: z"), ToolCall("echo", "")])
def test_compact_round_trip(call):
    text = format_tool_call(call, "compact")
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    assert parse_tool_call(f"Let me compute. {text} then answer", "compact") == call


@pytest.mark.parametrize("call", [ToolCall("calculator", {"expression": "1+1"}), ToolCall("python", {"code": "ü"}),
                                  ToolCall("f", {}), ToolCall("g", "raw string")])
def test_json_round_trip(call):
    assert parse_tool_call(format_tool_call(call, "json"), "json") == call


def test_compact_parse_details():
    assert parse_tool_call("the answer is 7") is None
    assert parse_tool_call("<tool_call> calculator :  1 + 2 \n</tool_call>") == ToolCall("calculator", "1 + 2")
    first = parse_tool_call("<tool_call>a: 1</tool_call> <tool_call>b: 2</tool_call>")
    assert first == ToolCall("a", "1")  # only the first call of a turn counts
    assert parse_tool_call("<tool_call>a: 1</tool_call> <tool_call>unclosed") == ToolCall("a", "1")


@pytest.mark.parametrize("text,fmt,message", [
    ("<tool_call>calculator: 1+1", "compact", "unclosed <tool_call>"),
    ("<tool_call>: 1+1</tool_call>", "compact", "empty tool name"),
    ("<tool_call>calculator 1+1</tool_call>", "compact", "no ':'"),
    ("<tool_call>my calc: 1</tool_call>", "compact", "contains spaces"),
    ('<tool_call>{"name": "f", "arguments": {</tool_call>', "json", "not valid JSON"),
    ('<tool_call>["f"]</tool_call>', "json", "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "json", 'no "name"'),
    ('<tool_call>{"name": " "}</tool_call>', "json", 'no "name"'),
    ('<tool_call>{"name": "f", "arguments": 3}</tool_call>', "json", "must be an object or a string"),
    ('<tool_call>{"name": "f"', "json", "unclosed"),
])
def test_malformed_calls_raise_one_line(text, fmt, message):
    with pytest.raises(ToolCallError, match=message) as info:
        parse_tool_call(text, fmt)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_format_and_unwritable_calls():
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'; valid: compact, json"):
        parse_tool_call("x", "xml")
    with pytest.raises(ValueError, match="one string argument"):
        format_tool_call(ToolCall("calculator", {"expression": "1"}), "compact")
    with pytest.raises(ValueError, match="may not contain"):
        format_tool_call(ToolCall("python", "print('</tool_call>')"), "compact")
    with pytest.raises(ValueError, match="cannot be written"):
        format_tool_call(ToolCall("my tool", "1"), "compact")


def test_tool_prompt_lists_tools_and_format():
    tools = [build_tool("calculator"), build_tool("python", {"isolation": "process"})]
    compact = tool_prompt(tools, "compact")
    assert "<tool_call>NAME: ARGUMENTS</tool_call>" in compact
    assert "- calculator: evaluates an arithmetic expression" in compact and "- python: runs a Python" in compact
    as_json = tool_prompt(tools, "json")
    assert '"arguments"' in as_json and '- calculator (arguments {"expression": "..."})' in as_json
    assert '- python (arguments {"code": "..."})' in as_json
