"""Episodes: environments that answer the model's turns, until done.

A single-turn env (:class:`xrlhf.envs.Env`) gives a prompt and scores one response. An
:class:`EpisodeEnv` runs a conversation instead: the model acts (one generated turn), the env
answers with an observation (a chat message: a tool's output, feedback, a hint) and optionally a
reward, and so on until the env says ``done`` or a limit ends it (``max_turns``, the episode's
token budget, a turn that hits ``policy.generate.max_new_tokens`` without a stop token).

The episode runner (``xrlhf.algorithms.rollout.episodes``) keeps the trajectory as **token ids**: the
model's sampled tokens go into it as sampled, never decoded and re-encoded; the env's
observations are rendered by the chat template (``xrlhf.data.chat``) and appended as ids that
the loss masks out. An env sees text (``Episode.step(action)`` gets the decoded turn) and
answers with a message; it never touches ids.

Episode envs are registered like every env (``@register_env``); their prompts carry
``messages`` (``Prompt.messages``), so the chat template of the policy's tokenizer applies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from xrlhf.envs.base import Env, EnvOptions, Prompt, Score

Message = dict[str, str]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``."""


@dataclass
class Turn:
    """The env's answer to one action of the model.

    Attributes:
        observation: the message appended to the conversation (``role`` ``user`` or ``tool``);
            ``None`` when ``done`` (nothing follows).
        reward: this turn's reward; an episode's return is the sum over its turns.
        done: the episode is over (a final answer was given, or the env gives up).
        correct: on the final turn of a verifiable task, whether the answer was right.
        info: per-turn counters summed over the episode for metrics (``tool_calls``,
            ``tool_errors``, ...); numbers only.
    """

    observation: Message | None = None
    reward: float = 0.0
    done: bool = False
    correct: bool | None = None
    info: dict[str, float] = field(default_factory=dict)


class Episode(ABC):
    """The state of one episode (one sample); made by :meth:`EpisodeEnv.start`.

    ``step`` may be called from a worker thread (tools run there), one call at a time per
    episode; episodes of a batch run concurrently, so an episode must not share mutable state
    with another.
    """

    @abstractmethod
    def step(self, action: str) -> Turn:
        """The env's answer to ``action``: the model's turn as text (stop token removed,
        surrounding whitespace stripped)."""

    def truncated(self) -> Score:
        """The judgement of an episode that a limit cut short (turns, tokens, a turn without a
        stop token): reward 0 and not correct unless an env says otherwise. The runner marks
        the sample ``truncated`` (a metric, and ``episode.mask_truncated`` can drop it from the
        loss); it is never silently scored as a finished answer."""
        return Score(0.0, correct=False)


class EpisodeOptions(EnvOptions):
    """Options every episode env has (its ``Config`` subclasses this)."""

    max_turns: int = Field(4, ge=1, description="model turns per episode; more is truncation")
    max_episode_tokens: int = Field(512, ge=1, description="tokens after the prompt (model turns and "
                                    "observations together); more is truncation")
    mask_truncated: bool = Field(False, description="leave truncated episodes out of the loss (their "
                                 "tokens get loss mask 0), as DAPO's overlong filtering")
    step_timeout_s: float = Field(60.0, gt=0, description="an env's answer to one turn (Episode.step, its tool "
                                  "calls included) that takes longer is abandoned (xrlhf.utils.bounded): the episode "
                                  "ends truncated and the log names the env and the prompt")


class EpisodeEnv(Env):
    """An env whose samples are episodes of one or more turns (see the module docstring).

    Subclasses set ``Config`` (a subclass of :class:`EpisodeOptions`), implement
    :meth:`train_prompts` / :meth:`eval_prompts` (prompts with ``messages``) and :meth:`start`.
    ``score`` is not used: rewards come from the turns.
    """

    Config: ClassVar[type[EpisodeOptions]] = EpisodeOptions
    config: EpisodeOptions
    multi_turn: ClassVar[bool] = True
    counters: ClassVar[tuple[str, ...]] = ()
    """The ``Turn.info`` keys this env reports: every episode's metrics carry them (0 when no
    turn of the episode set one, e.g. every turn was cut short), so each step logs the same keys."""

    @abstractmethod
    def start(self, prompt: Prompt) -> Episode:
        """A fresh episode for ``prompt`` (deterministic in the prompt: no hidden randomness)."""

    def sft_conversations(self, start: int, n: int) -> list[list[Message]]:
        """Whole conversations (prompt messages, then assistant turns and observations, ending
        with an assistant turn) for a supervised warm-up: the assistant turns are trained.

        Raises:
            NotImplementedError: for an env without demonstrations.
        """
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations for a warm-up; set "
                                  f"warmup.steps: 0 or override sft_conversations()")

    def score(self, prompts: list[Prompt], responses: list[str]) -> list[Score]:
        """A one-turn judgement of each response (``start(p).step(r)``): what a reward function or
        a single-turn evaluation of this env sees. A turn that is not ``done`` is truncated."""
        out = []
        for p, r in zip(prompts, responses):
            episode = self.start(p)
            turn = episode.step(r)
            out.append(Score(turn.reward, turn.correct) if turn.done else episode.truncated())
        return out

    def max_prompt_tokens(self, tokenizer, sample: int = 256) -> int:
        """The longest first prompt (template applied). ``xrlhf validate`` checks it plus
        ``max_episode_tokens`` (all that may follow it) against the model's positions."""
        from xrlhf.data.text import encode_prompt

        prompts = self.eval_prompts() + self.train_prompts(0, sample)
        return max(len(encode_prompt(tokenizer, p)) for p in prompts)


def is_episode_env(env: Any) -> bool:
    """Whether ``env`` (an instance or a class) runs multi-turn episodes."""
    return bool(getattr(env, "multi_turn", False))
