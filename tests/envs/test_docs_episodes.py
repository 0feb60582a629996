"""docs/episodes.md's tool-using env runs as written: its ``# my_pkg/<file>.py`` blocks become a
package, its YAML validates (the sandboxed tool starts), and an episode calls the tool, reads its
answer and is judged as the page says; ``system_prompt`` acts through ``first_messages``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from xrlhf.envs import build_env
from xrlhf.envs.base import ENVS
from xrlhf.tools.sandbox import SandboxedTool
from xrlhf.validation import validate_dict

DOC = Path(__file__).resolve().parents[2] / "docs" / "episodes.md"


@pytest.fixture
def my_pkg(tmp_path, monkeypatch):
    """The page's blocks as the package ``my_pkg``, on the path (readable by the tool's sandbox)."""
    blocks = re.findall(r"```python\n(# my_pkg/(\w+)\.py\n.*?)```", DOC.read_text(), re.S)
    assert {name for _, name in blocks} == {"envs", "tools", "tool_env"}
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    for code, name in blocks:
        (tmp_path / "my_pkg" / f"{name}.py").write_text(code)
    tmp_path.chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ENVS, "_items", dict(ENVS._items))  # the page's registrations stay here
    yield
    for m in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        del sys.modules[m]


def page_config() -> dict:
    return yaml.safe_load(re.search(r"```yaml\n(env:\n.*?)```", DOC.read_text(), re.S).group(1))


def test_the_pages_config_validates_with_its_sandboxed_tool(my_pkg, tiny_model):
    data = {**page_config(), "policy": {"model": tiny_model, "generate": {"max_new_tokens": 16}}, "reference": None,
            "algorithm": {"name": "grpo", "kl_coef": 0, "mini_batch_size": 4},
            "trainer": {"prompts_per_step": 2, "samples_per_prompt": 2}}
    cfg = validate_dict(data)  # starts the tool in its sandbox, calls start and sft_conversations once
    assert cfg.env.name == "my_pkg.tool_env:CapitalEnv" and cfg.warmup.steps == 50


def test_an_episode_calls_the_tool_and_is_judged(my_pkg):
    env = build_env("my_pkg.tool_env:CapitalEnv", page_config()["env"]["options"], seed=0)
    assert isinstance(env.tools["capital"], SandboxedTool) and env.tools["capital"].config.timeout_s == 2
    train = {p.text for p in env.train_prompts(0, 50)}
    togo = next(p for p in env.eval_prompts() if p.text == "capital of togo?")
    assert togo.text not in train and togo.messages == ({"role": "user", "content": "capital of togo?"},)
    episode = env.start(togo)
    call = episode.step("<tool_call>capital: togo</tool_call>")
    assert call.observation == {"role": "tool", "content": "Lome"} and not call.done
    assert call.info == {"tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}
    wrong = episode.step("<tool_call>capital: atlantis</tool_call>")
    assert wrong.observation["content"] == "error: no country 'atlantis'" and wrong.info["tool_errors"] == 1.0
    answer = episode.step("Lome")
    assert answer.done and answer.correct and answer.reward == 1.0
    (demo,) = env.sft_conversations(0, 1)
    assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant"]
    assert demo[1]["content"].startswith("<tool_call>capital: ") and demo[2]["content"] == demo[3]["content"]
    env.tools["capital"].close()


def test_system_prompt_lists_the_tools_through_first_messages(my_pkg):
    options = {**page_config()["env"]["options"], "system_prompt": True}
    env = build_env("my_pkg.tool_env:CapitalEnv", options, seed=0)
    system, user = env.train_prompts(0, 1)[0].messages
    assert system["role"] == "system" and "- capital: gives the capital of a country" in system["content"]
    assert "<tool_call>NAME: ARGUMENTS</tool_call>" in system["content"] and user["role"] == "user"
    assert env.sft_conversations(0, 1)[0][0] == system  # the warm-up sees the context RL sees
    env.tools["capital"].close()
