"""Tool base: registry, building with options, call_tool's guarantees, config-layer errors."""

import json
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

from xrlhf.tools import (TOOLS, Tool, ToolOptions, ToolResult, ToolSpec, build_tool, call_tool, register_tool,
                         tool_errors)
from xrlhf.tools.base import truncate
from xrlhf.tools.calculator import Calculator


class Boom(Tool):
    name = "boom"
    description = "always fails"

    def run(self, arguments):
        raise RuntimeError("kaput\nsecond line")


class Chatty(Tool):
    name = "chatty"
    description = "talks a lot"

    def run(self, arguments):
        return ToolResult("a" * 5000 + "THE END")


def test_registry_lists_tools_by_file_and_unknown_names_list_them():
    assert TOOLS.names() == ["calculator", "python"]
    assert TOOLS.get("calculator") is Calculator
    with pytest.raises(KeyError, match=r"unknown tool 'calcx'; valid: calculator, python"):
        build_tool("calcx")


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="tool 'calculator' is already registered"):
        @register_tool("calculator")
        class Other(Tool):
            def run(self, arguments):
                return ToolResult("")
    with pytest.raises(ValueError, match="must match"):
        register_tool("two words")
    with pytest.raises(ValueError, match="has name 'a' but is registered as 'b'"):
        @register_tool("b")
        class Named(Tool):
            name = "a"


def test_import_path_builds_a_user_tool(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent("""
        from pydantic import Field
        from xrlhf.tools import Tool, ToolOptions, ToolResult

        class ShoutOptions(ToolOptions):
            times: int = Field(1, ge=1)

        class Shout(Tool):
            name = "shout"
            description = "repeats its input in capitals"
            Config = ShoutOptions

            def run(self, arguments):
                return ToolResult(self.text_argument(arguments).upper() * self.config.times)

        class Nameless(Tool):
            def run(self, arguments):
                return ToolResult("")
    """))
    tmp_path.chmod(0o755)  # a sandboxed tool's module must be readable by the namespace sandbox's user
    monkeypatch.syspath_prepend(str(tmp_path))
    tool = build_tool("my_tools:Shout", {"times": 2})
    assert call_tool(tool, "hi").output == "HIHI"
    with pytest.raises(TypeError, match="set the class attribute name"):
        build_tool("my_tools:Nameless")
    with pytest.raises(TypeError, match="not a subclass of xrlhf.tools.Tool"):
        build_tool("my_tools:ShoutOptions")
    with pytest.raises(KeyError, match="has no attribute 'Missing'"):
        build_tool("my_tools:Missing")
    assert tool_errors([{"name": "my_tools:Shout", "options": {"times": 0}}], "env.options.tools") == [
        "env.options.tools[0].options.times: Input should be greater than or equal to 1 (got 0)"]


def test_bad_options_raise_validation_error():
    with pytest.raises(ValidationError, match="timeout_s"):
        build_tool("calculator", {"timeout_s": 0})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        build_tool("python", {"memory": 100})
    with pytest.raises(TypeError, match="expected CalculatorOptions"):
        Calculator(ToolOptions())


def test_tool_errors_one_line_each_with_the_yaml_path():
    specs = [{"name": "calculator"}, {"name": "calcx"}, {"name": "python", "options": {"timeout_s": -1, "bogus": 1}},
             "calculator", ToolSpec(name="calculator", options={"max_digits": 20})]
    assert tool_errors(specs, "env.options.tools") == [
        "env.options.tools[1].name: unknown tool 'calcx'; valid: calculator, python "
        "(or an import path 'pkg.module:Name')",
        "env.options.tools[2].options.timeout_s: Input should be greater than 0 (got -1)",
        "env.options.tools[2].options.bogus: Extra inputs are not permitted (got 1)",
        "env.options.tools[3]: expected {name: <tool>, options: {...}}, got 'calculator'",
        "env.options.tools[4].name: tool 'calculator' is already env.options.tools[0]; list each tool once",
    ]
    assert tool_errors([{"name": "calculator"}, {"name": "python", "options": {"timeout_s": 2}}], "tools") == []


def test_a_tool_timeout_must_be_below_the_turns():
    specs = [{"name": "calculator"}, {"name": "python", "options": {"timeout_s": 60}}]
    assert tool_errors(specs, "env.options.tools", step_timeout_s=60) == [
        "env.options.tools[1].options.timeout_s: 60 s is not below the turn's limit (env.options.step_timeout_s: "
        "60 s), which abandons the turn first; lower timeout_s or raise step_timeout_s"]
    assert tool_errors(specs, "env.options.tools", step_timeout_s=61) == []
    assert tool_errors([{"name": "calculator"}], "t", step_timeout_s=5) != []  # its default of 5 s too


def test_call_tool_never_raises_and_caps_output():
    boom = Boom()
    result = call_tool(boom, "x")
    assert result.error and result.output == "error: RuntimeError: kaput | second line"
    assert result.seconds >= 0
    wrong = type("Wrong", (Boom,), {"run": lambda self, a: "not a result"})()
    assert call_tool(wrong, "x").output == "error: tool 'boom' returned str, not a ToolResult"
    leaves = type("Leaves", (Boom,), {"run": lambda self, a: sys.exit(2)})()
    assert call_tool(leaves, "x").output == "error: SystemExit: 2"
    chatty = Chatty(ToolOptions(max_output_chars=100))
    out = call_tool(chatty, "").output
    assert len(out) <= 100 and out.endswith("THE END") and "[cut: 5007 chars in all]" in out


@pytest.mark.parametrize("n", [5, 16, 40, 100, 1000])
def test_truncate_respects_the_limit(n):
    text = "x" * 3000
    assert len(truncate(text, n)) <= n
    assert truncate("short", n) == "short"


def test_tools_import_nothing_of_xrlhf_but_utils():
    code = ("import importlib, json, pkgutil, sys, xrlhf.tools\n"
            "for m in pkgutil.iter_modules(xrlhf.tools.__path__):\n"
            "    importlib.import_module('xrlhf.tools.' + m.name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    mods = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    packages = {m.split(".")[1] for m in mods if m.startswith("xrlhf.")}
    assert packages <= {"tools", "utils"}, packages
    assert not {"torch", "ray", "vllm"} & {m.split(".")[0] for m in mods}
