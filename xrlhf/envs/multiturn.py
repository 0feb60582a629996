"""Two multi-turn episode envs without tools: Q&A with feedback, and guess-the-number.

``multiturn_qa``: the ``reasoning`` env's problems (``problems``: its options), answered in up
to ``max_turns`` tries; a wrong answer gets ``feedback`` ("wrong, try again") as a user message.
A right answer at try ``t`` earns ``reward_correct * discount ** (t - 1)``; a wrong last try ends
the episode lost (done, reward 0: the game's rule, not a truncation). Counters:
``first_turn_correct`` (so first-try and final accuracy are both reported) and ``retries``.

``guess``: the env thinks of a number in ``1 .. max_number``; each turn the model guesses, the
env answers ``higher`` or ``lower`` (or asks for a number), until found or ``max_turns``. Found
at turn ``t``: ``discount ** (t - 1)``; a wrong (valid) guess at turn ``max_turns`` loses the game
(done, reward 0; an invalid one there is a truncation). Several steps of interaction are the only way to the
reward: binary search finds any number in ``ceil(log2(max_number + 1))`` turns. The held-out
split is every number once (cycled up to ``eval_size``); training numbers are drawn per index
(the same numbers appear on both sides: the task is the search, not the number).
"""

from __future__ import annotations

import random
from functools import cached_property

from pydantic import Field

from xrlhf.envs.base import Prompt, clean_response, register_env
from xrlhf.envs.episode import Episode, EpisodeEnv, EpisodeOptions, Message, Turn
from xrlhf.envs.reasoning import ReasoningEnv, ReasoningOptions


class MultiTurnQAOptions(EpisodeOptions):
    """``env.options`` of ``multiturn_qa``."""

    problems: ReasoningOptions = Field(default_factory=ReasoningOptions,
                                       description="the problems: options of the reasoning env")
    max_turns: int = Field(3, ge=1)
    max_episode_tokens: int = Field(64, ge=1)
    feedback: str = Field("wrong, try again", min_length=1)
    discount: float = Field(0.5, gt=0, le=1, description="reward factor per extra try")


class _Tries(Episode):
    """Judges each try of one problem; wrong ones get the feedback."""

    def __init__(self, prompt: Prompt, o: MultiTurnQAOptions):
        self.prompt, self.o, self.tries = prompt, o, 0

    def step(self, action: str) -> Turn:
        self.tries += 1
        correct = clean_response(action) == self.prompt.answer
        info = {"first_turn_correct": float(correct and self.tries == 1), "retries": float(self.tries > 1)}
        if correct:
            reward = self.o.problems.reward_correct * self.o.discount ** (self.tries - 1)
            return Turn(reward=reward, done=True, correct=True, info=info)
        if self.tries >= self.o.max_turns:  # out of tries: lost, not cut short (not truncation)
            return Turn(done=True, correct=False, info=info)
        return Turn(observation={"role": "user", "content": self.o.feedback}, info=info)


@register_env("multiturn_qa")
class MultiTurnQAEnv(EpisodeEnv):
    """Reasoning problems with up to ``max_turns`` tries and feedback (module docstring)."""

    Config = MultiTurnQAOptions
    config: MultiTurnQAOptions
    counters = ("first_turn_correct", "retries")

    @cached_property
    def problems(self) -> ReasoningEnv:
        return ReasoningEnv(self.config.problems, self.seed)

    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        return [_as_chat(p) for p in self.problems.train_prompts(start, n)]

    def eval_prompts(self) -> list[Prompt]:
        return [_as_chat(p) for p in self.problems.eval_prompts()]

    def start(self, prompt: Prompt) -> Episode:
        return _Tries(prompt, self.config)

    def sft_conversations(self, start: int, n: int) -> list[list[Message]]:
        """Right first answers (the warm-up teaches the format; retries are RL's to learn)."""
        return [[*p.messages, {"role": "assistant", "content": p.answer}] for p in self.train_prompts(start, n)]


def _as_chat(p: Prompt) -> Prompt:
    return Prompt(text=p.text, answer=p.answer, task=p.task, index=p.index,
                  messages=({"role": "user", "content": p.text},))


class GuessOptions(EpisodeOptions):
    """``env.options`` of ``guess``."""

    max_number: int = Field(16, ge=2, le=10**6)
    max_turns: int = Field(6, ge=1)
    max_episode_tokens: int = Field(160, ge=1)
    discount: float = Field(0.9, gt=0, le=1, description="reward factor per extra guess")
    eval_size: int = Field(64, ge=1)


class _Guessing(Episode):
    def __init__(self, secret: int, o: GuessOptions):
        self.secret, self.o, self.turns = secret, o, 0

    def step(self, action: str) -> Turn:
        self.turns += 1
        text = clean_response(action)
        if not text.isdigit() or not 1 <= int(text) <= self.o.max_number:
            return Turn(observation={"role": "user", "content": f"a number from 1 to {self.o.max_number}"},
                        info={"invalid_guesses": 1.0})
        guess = int(text)
        if guess == self.secret:
            return Turn(reward=self.o.discount ** (self.turns - 1), done=True, correct=True,
                        info={"invalid_guesses": 0.0})
        if self.turns >= self.o.max_turns:  # out of guesses: lost, not cut short (not truncation)
            return Turn(done=True, correct=False, info={"invalid_guesses": 0.0})
        hint = "higher" if self.secret > guess else "lower"
        return Turn(observation={"role": "user", "content": hint}, info={"invalid_guesses": 0.0})


@register_env("guess")
class GuessEnv(EpisodeEnv):
    """Guess the number with higher/lower feedback (module docstring)."""

    Config = GuessOptions
    config: GuessOptions
    counters = ("invalid_guesses",)

    def _prompt(self, secret: int, index: int) -> Prompt:
        text = f"guess 1-{self.config.max_number}"
        return Prompt(text=text, answer=str(secret), task="guess", index=index,
                      messages=({"role": "user", "content": text},))

    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        m = self.config.max_number
        return [self._prompt(random.Random(f"{self.seed}/train/{i}").randint(1, m), i) for i in range(start, start + n)]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(i % self.config.max_number + 1, i) for i in range(self.config.eval_size)]

    def start(self, prompt: Prompt) -> Episode:
        return _Guessing(int(prompt.answer), self.config)

    def sft_conversations(self, start: int, n: int) -> list[list[Message]]:
        """Binary-search transcripts (guess the middle of what is left; the hint narrows it)."""
        out = []
        for p in self.train_prompts(start, n):
            lo, hi, secret = 1, self.config.max_number, int(p.answer)
            conv: list[Message] = list(p.messages)
            while True:
                guess = (lo + hi) // 2
                conv.append({"role": "assistant", "content": str(guess)})
                if guess == secret:
                    break
                lo, hi = (guess + 1, hi) if secret > guess else (lo, guess - 1)
                conv.append({"role": "user", "content": "higher" if secret > guess else "lower"})
            out.append(conv)
        return out
