"""The environment protocol: where prompts come from and how responses are rewarded.

An environment is a small class, not a dataset file plus a reward script, so that the trainer
needs only two things from it: a deterministic stream of training prompts addressed by an
integer (resuming a run means remembering one ``int``) and a fixed held-out split. Rewards
from rules live in :meth:`Env.score`; environments whose reward comes from a reward model set
``reward_source = "model"`` and leave scoring to the trainer.

Conventions shared by every environment:

* A response is judged after stripping the end-of-sequence token and surrounding whitespace
  (:func:`clean_response`).
* ``sft_examples`` targets are the answer text only; the trainer appends EOS.

Environments register by name (``@register_env("name")``); YAML may also name one by import
path ``pkg.module:Class``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from xrlhf.utils.registry import Registry

ENVS: Registry[type] = Registry("env")

EOS_TOKENS = ("</s>",)
"""End-of-sequence strings :func:`clean_response` removes if a response was decoded with them."""


def register_env(name: str):
    """Class decorator: ``@register_env("name")`` adds an :class:`Env` subclass to ``ENVS``.

    Raises:
        ValueError: if another object is already registered as ``name``.
    """
    return ENVS.register(name)


@dataclass(frozen=True)
class Prompt:
    """One problem for the policy.

    Attributes:
        text: what the policy sees (the trainer tokenizes it); for a prompt with ``messages``,
            the last user message's content (for logs).
        answer: the reference answer, if the task has one.
        task: the task family, for per-task metrics.
        index: the position in its split; ``train_prompts(i, 1)[0].index == i``.
        messages: chat messages (``{"role": ..., "content": ...}``) for the policy's chat
            template (``xrlhf.data.chat``), instead of ``text``; ``None`` for plain text.
            Not hashed, so prompts stay usable in sets.
    """

    text: str
    answer: str | None = None
    task: str = ""
    index: int = 0
    messages: tuple[dict, ...] | None = field(default=None, hash=False)


@dataclass
class Score:
    """The judgement of one response.

    Attributes:
        reward: the scalar reward.
        correct: whether the answer is right, for verifiable tasks (``None`` otherwise).
        info: extra per-sample values for logging (at least ``task`` for task families).
    """

    reward: float
    correct: bool | None = None
    info: dict[str, Any] = field(default_factory=dict)


class EnvOptions(BaseModel):
    """The options of an environment that takes none; the base of every ``Env.Config``."""

    model_config = ConfigDict(extra="forbid")


class Env(ABC):
    """A source of prompts and (for ``reward_source = "rule"``) their rewards.

    Subclasses set ``Config``, a pydantic model of the YAML section ``env.options`` that
    forbids unknown keys, and implement :meth:`train_prompts`, :meth:`eval_prompts` and, for
    rule rewards, :meth:`score`.

    Args:
        config: an instance of ``Config`` (``None``: all defaults).
        seed: the training stream and the eval split are functions of ``(config, seed)``.
    """

    Config: ClassVar[type[BaseModel]] = EnvOptions
    reward_source: ClassVar[Literal["rule", "model"]] = "rule"

    def __init__(self, config: BaseModel | None = None, seed: int = 0):
        if config is None:
            config = self.Config()
        if not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__}: config is a {type(config).__name__}, "
                            f"expected {self.Config.__name__}")
        self.config = config
        self.seed = seed

    @abstractmethod
    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        """Prompts ``start .. start + n - 1`` of the infinite training stream.

        Deterministic in ``(seed, index)``, so a run resumes from one integer; never contains
        a prompt of :meth:`eval_prompts`.
        """

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out split, disjoint from every training prompt."""

    def score(self, prompts: list[Prompt], responses: list[str]) -> list[Score]:
        """Rule rewards for ``responses[i]`` to ``prompts[i]`` (see :func:`clean_response`).

        Raises:
            NotImplementedError: for an environment without rule rewards.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no rule reward (reward_source={self.reward_source!r}); "
            f"rewards come from the reward model, or override score()")

    def max_prompt_tokens(self, tokenizer, sample: int = 1024) -> int:
        """The longest prompt in tokens as the trainer encodes it (BOS included).

        ``xrlhf validate`` checks it plus ``policy.generate.max_new_tokens`` against the
        models' positions before anything starts (the trainer checks each rollout too). The
        default measures the held-out prompts and the first ``sample`` training prompts; an env
        that can say its longest prompt exactly and cheaply overrides it.
        """
        from xrlhf.data.text import encode_prompt

        texts = {p.text for p in self.eval_prompts()} | {p.text for p in self.train_prompts(0, sample)}
        return max(len(encode_prompt(tokenizer, t)) for t in texts)

    def sft_examples(self, start: int, n: int) -> list[tuple[str, str]]:
        """``(prompt text, target completion)`` pairs for a supervised warm-up.

        The default pairs :meth:`train_prompts` with their answers; the target excludes EOS.

        Raises:
            NotImplementedError: if a training prompt has no answer.
        """
        pairs = []
        for p in self.train_prompts(start, n):
            if p.answer is None:
                raise NotImplementedError(f"{type(self).__name__}: training prompt {p.index} has "
                                          f"no answer; override sft_examples()")
            pairs.append((p.text, p.answer))
        return pairs


def clean_response(text: str) -> str:
    """``text`` without surrounding whitespace and trailing end-of-sequence tokens."""
    text = text.strip()
    stripped = True
    while stripped:
        stripped = False
        for eos in EOS_TOKENS:
            if text.endswith(eos):
                text, stripped = text[: -len(eos)].rstrip(), True
    return text


def check_pairs(prompts: list[Prompt], responses: list[str]) -> None:
    """Raise ``ValueError`` unless there is one response per prompt."""
    if len(prompts) != len(responses):
        raise ValueError(f"score: {len(prompts)} prompts but {len(responses)} responses")


def build_env(name: str, options: dict[str, Any] | None, seed: int) -> Env:
    """The environment ``name`` (registered name or ``pkg.module:Class``) with validated options.

    Args:
        name: a name in ``ENVS`` or an import path.
        options: the YAML section ``env.options`` (``None`` or ``{}``: defaults).
        seed: passed to the environment.

    Raises:
        KeyError: for an unknown name, listing the valid ones.
        TypeError: if ``name`` resolves to something that is not an ``Env`` subclass.
        pydantic.ValidationError: for bad options (the caller prefixes the YAML path).
    """
    cls = ENVS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"env {name!r} is {cls!r}, not a subclass of xrlhf.envs.Env")
    config = cls.Config.model_validate(options or {})
    return cls(config, seed)
