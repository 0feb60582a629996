"""``calc``: arithmetic with operands too large to work out "in the head", and a calculator tool.

The tool env of issue 15: a tiny model cannot multiply two 3-digit numbers by itself, but it can
learn to write ``<tool_call>calculator: 482*917</tool_call>``, read the tool's answer and copy
it, so the way to a high reward goes through the tool. With ``tools: []`` the same problems
must be answered directly: the baseline the tool env is compared with (docs/algorithms.md).

A problem is ``{a}{op}{b}=`` (operands of ``min_digits`` .. ``max_digits`` digits), the answer
its exact integer value; reward ``reward_correct`` for an exactly right final answer, else 0.
The held-out split is the problems whose text hashes (crc32) to 0 modulo 8: the same in every
run with the same options, never drawn for training.

Warm-up demonstrations (``sft_conversations``): a ``sft_tool_fraction`` of them call the
calculator first and copy its output; the rest answer at once (the right number, which a tiny
model cannot learn to compute), so after the warm-up the policy calls the tool on part of the
problems, and RL can raise that part.
"""

from __future__ import annotations

import random
import zlib
from functools import cached_property
from typing import Literal

from pydantic import Field, model_validator

from xrlhf.envs.base import Prompt, clean_response, register_env
from xrlhf.envs.episode import EpisodeEnv, Message
from xrlhf.envs.tool_use import TOOL_COUNTERS, ToolEnvOptions, ToolSpec, ToolUseEpisode, first_messages
from xrlhf.tools.format import ToolCall, format_tool_call

Op = Literal["+", "-", "*"]


class CalcOptions(ToolEnvOptions):
    """``env.options`` of the ``calc`` environment."""

    tools: list[ToolSpec] = Field(default_factory=lambda: [ToolSpec(name="calculator")],
                                  description="the tools offered ([]: answer without a calculator)")
    max_turns: int = Field(3, ge=1)
    max_episode_tokens: int = Field(96, ge=1)
    ops: list[Op] = Field(default_factory=lambda: ["*"], description="operators, used in turn")
    min_digits: int = Field(3, ge=1, le=12)
    max_digits: int = Field(3, ge=1, le=12)
    eval_size: int = Field(128, ge=1)
    reward_correct: float = 1.0
    sft_tool_fraction: float = Field(1.0, ge=0, le=1, description="warm-up demonstrations that call the "
                                     "calculator (the rest answer directly)")

    @model_validator(mode="after")
    def _digits(self) -> "CalcOptions":
        if self.min_digits > self.max_digits:
            raise ValueError(f"env.options.min_digits: {self.min_digits} exceeds max_digits ({self.max_digits}); "
                             f"lower it")
        if not self.ops:
            raise ValueError("env.options.ops: choose at least one of +, -, *")
        return self


@register_env("calc")
class CalcEnv(EpisodeEnv):
    """Large-operand arithmetic; the calculator tool makes it easy (module docstring)."""

    Config = CalcOptions
    config: CalcOptions
    counters = TOOL_COUNTERS

    @cached_property
    def tools(self):
        return self.config.build_tools()

    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        if start < 0 or n < 0:
            raise ValueError(f"calc: train_prompts(start={start}, n={n}) needs both >= 0")
        return [self._prompt("train", i) for i in range(start, start + n)]

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    @cached_property
    def _eval(self) -> list[Prompt]:
        return [self._prompt("eval", i) for i in range(self.config.eval_size)]

    def _prompt(self, split: str, index: int) -> Prompt:
        o = self.config
        op = o.ops[index % len(o.ops)]
        rng = random.Random(f"{self.seed}/{split}/{index}")
        while True:
            a, b = (_number(rng, rng.randint(o.min_digits, o.max_digits)) for _ in range(2))
            text = f"{a}{op}{b}="
            if (zlib.crc32(text.encode()) % 8 == 0) == (split == "eval"):
                break
        answer = str(a + b if op == "+" else a - b if op == "-" else a * b)
        return Prompt(text=text, answer=answer, task=f"calc{op}", index=index,
                      messages=first_messages(o, self.tools, text))

    def start(self, prompt: Prompt) -> ToolUseEpisode:
        answer = prompt.answer

        def judge(text: str) -> tuple[float, bool]:
            correct = clean_response(text) == answer
            return (self.config.reward_correct if correct else 0.0), correct

        return ToolUseEpisode(self.tools, self.config.tool_format, judge,
                              where=f"env {type(self).__name__}, prompt {prompt.text[:60]!r}")

    def sft_conversations(self, start: int, n: int) -> list[list[Message]]:
        """Demonstrations: a ``sft_tool_fraction`` call the calculator, then copy its output."""
        out = []
        for p in self.train_prompts(start, n):
            conv = list(p.messages)
            use_tool = "calculator" in self.tools and \
                random.Random(f"{self.seed}/sft/{p.index}").random() < self.config.sft_tool_fraction
            if use_tool:
                call = format_tool_call(ToolCall("calculator", p.text.rstrip("=")), self.config.tool_format)
                conv += [{"role": "assistant", "content": call}, {"role": "tool", "content": p.answer}]
            conv.append({"role": "assistant", "content": p.answer})
            out.append(conv)
        return out


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)
