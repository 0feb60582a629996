"""docs/tools.md runs as written: its ``# mypkg/tools.py`` block is a tool chosen by import path,
and its YAML example validates."""

import re
import sys
from pathlib import Path

import pytest
import yaml

from xrlhf.tools import build_tool, call_tool, parse_tool_call, tool_errors, tool_prompt

DOC = Path(__file__).resolve().parents[2] / "docs" / "tools.md"


@pytest.fixture
def mypkg(tmp_path, monkeypatch):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    blocks = re.findall(r"```python\n(# mypkg/tools\.py\n.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1
    (tmp_path / "mypkg" / "tools.py").write_text(blocks[0])
    tmp_path.chmod(0o755)  # readable by the namespace sandbox's user, as a user's package dir is
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for m in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[m]


def test_the_pages_tool_and_config_work(mypkg):
    lookup = build_tool("mypkg.tools:Lookup", {"table": {"pi": "3.14159"}})
    call = parse_tool_call("I need pi. <tool_call>lookup: PI</tool_call>")
    assert call.name == lookup.name and call_tool(lookup, call.arguments).output == "3.14159"
    assert call_tool(lookup, {"word": "e"}).output == "error: no entry for 'e'"
    assert "- lookup: looks a word up in a fixed table" in tool_prompt([lookup])
    specs = yaml.safe_load(re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S).group(1))["tools"]
    assert tool_errors(specs, "env.options.tools") == []
