"""A tool that gets stuck, and an env whose every turn calls it (``tests.e2e.stuck_tool:...`` by import
path in the tests' configs): issue 49's Ctrl-C with a tool stuck in ``run()``.

``Stuck.run`` answers at once until the file named by ``$XRLHF_TEST_STUCK`` exists; from then on it
never returns, whatever its ``timeout_s`` (with ``sandbox: none`` the call runs in the trainer's
process: the run can only abandon it).
"""

from __future__ import annotations

import os
import threading

from xrlhf.envs.base import Prompt
from xrlhf.envs.calc import CalcEnv
from xrlhf.envs.episode import Episode, Turn
from xrlhf.tools.base import Tool, ToolResult, call_tool

MARKER = "XRLHF_TEST_STUCK"


class Stuck(Tool):
    """Echoes its argument; stuck forever once the marker file exists."""

    name = "stuck"
    description = "echoes its input"

    def run(self, arguments) -> ToolResult:
        marker = os.environ.get(MARKER)
        if marker and os.path.exists(marker):
            threading.Event().wait()  # never returns, nor heeds timeout_s
        return ToolResult(str(arguments)[:20])


class EveryTurnCallsIt(CalcEnv):
    """``calc``'s prompts, one turn each: the model's answer goes through the first tool, then it
    is judged (reward 1 when right)."""

    def start(self, prompt: Prompt) -> Episode:
        return _Episode(next(iter(self.tools.values())), prompt.answer)


class _Episode(Episode):
    def __init__(self, tool: Tool, answer: str):
        self.tool, self.answer = tool, answer

    def step(self, action: str) -> Turn:
        result = call_tool(self.tool, action)
        return Turn(reward=float(action.strip() == self.answer), done=True, correct=action.strip() == self.answer,
                    info={"tool_calls": 1.0, "tool_errors": float(result.error),
                          "tool_timeouts": float(result.timed_out)})
