"""Verifiers: pure functions that say whether a completion gives a reference answer.

Why a module: the ``dataset`` env (:mod:`xrlhf.envs.dataset`) rewards answers read from a file,
and what counts as "the same answer" depends on the data: a capital city compares as text, a
word problem by the last number of a worked answer, a maths competition answer by the content
of the last ``\\boxed{...}``. Each is a function ``(completion, answer, **options) -> float``
(1.0 right, 0.0 wrong), chosen by name in ``env.options.verifier``, tested against
hand-computed cases, with its options validated by its own pydantic model.

A user's own verifier is named by import path ``package.module:function`` and has the signature
``(completion: str, answer: str) -> float``; it takes no options. The completion it gets has the
end-of-sequence token and surrounding whitespace removed (``xrlhf.envs.clean_response``).
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xrlhf.utils.registry import Registry, import_path

TRAILING_PUNCTUATION = ".,;:!? "
"""What :func:`normalize` strips from the end of an answer (after collapsing whitespace)."""

NUMBER = re.compile(r"(?<![\w.])-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
"""A number as written in text: an optional minus (not after a letter or digit, so ``7-2`` is
``7`` and ``2``), thousands separators (``1,234``), a decimal part and an exponent. Units after
it (``12 apples``, ``5km``, ``50%``) are not part of it; ``$`` is removed before matching."""

USER_VERIFIER = ("a verifier by import path is 'package.module:function', importable from the working "
                 "directory or PYTHONPATH, with the signature (completion: str, answer: str) -> float")
"""The fix every message about a user's verifier ends with."""

Verify = Callable[[str, str], float]
"""A verifier with its options bound: ``(completion, answer) -> reward``."""


class NoOptions(BaseModel):
    """The options of a verifier that takes none."""

    model_config = ConfigDict(extra="forbid")


class ToleranceOptions(NoOptions):
    """Options of the verifiers that compare numbers (:func:`same_number`)."""

    rel_tol: float = Field(1e-6, ge=0, description="relative tolerance of a numeric comparison")
    abs_tol: float = Field(0.0, ge=0, description="absolute tolerance of a numeric comparison")


@dataclass(frozen=True)
class Verifier:
    """A built-in verifier.

    Attributes:
        fn: ``fn(completion, answer, **options) -> float``.
        Config: the pydantic model of its options (``env.options.verifier_options``).
        answer_error: why a reference answer cannot be verified (``None``: it can); the env
            checks every row with it when it reads the dataset.
    """

    fn: Callable[..., float]
    Config: type[BaseModel] = NoOptions
    answer_error: Callable[[str], str | None] = lambda answer: None


VERIFIERS: Registry[Verifier] = Registry("verifier")


def register_verifier(name: str, config: type[BaseModel] = NoOptions,
                      answer_error: Callable[[str], str | None] | None = None):
    """Function decorator: ``@register_verifier("name", Options)`` adds a built-in verifier.

    Raises:
        ValueError: if ``name`` is registered already.
    """

    def deco(fn: Callable[..., float]) -> Callable[..., float]:
        VERIFIERS.register(name)(Verifier(fn, config, answer_error or (lambda answer: None)))
        return fn

    return deco


def normalize(text: str) -> str:
    """``text`` compared as an answer: case-folded, whitespace collapsed to single spaces, and
    surrounding whitespace and trailing punctuation (``.,;:!?``) removed."""
    return " ".join(text.split()).casefold().rstrip(TRAILING_PUNCTUATION)


def numbers(text: str) -> list[Decimal]:
    """Every number in ``text`` in order (see :data:`NUMBER`; ``$`` and thousands commas dropped)."""
    out = []
    for match in NUMBER.findall(text.replace("$", "")):
        try:
            out.append(Decimal(match.replace(",", "")))
        except InvalidOperation:  # an exponent too large for Decimal: not a number we can compare
            continue
    return out


def last_number(text: str) -> Decimal | None:
    """The last number in ``text``, or ``None`` if it has none."""
    found = numbers(text)
    return found[-1] if found else None


def same_number(got: Decimal, want: Decimal, rel_tol: float, abs_tol: float) -> bool:
    """Whether ``|got - want| <= max(rel_tol * max(|got|, |want|), abs_tol)`` (``math.isclose``'s
    rule), in decimal arithmetic: integers beyond a float's 53 bits still compare exactly."""
    try:
        bound = max(Decimal(repr(rel_tol)) * max(abs(got), abs(want)), Decimal(repr(abs_tol)))
        return abs(got - want) <= bound
    except ArithmeticError:  # an exponent beyond decimal's range (1e9999999): only equal is close
        return got == want


def boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, nested braces included; ``None`` if
    there is none or the last one is never closed (a completion cut off inside it)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    begin = start + len("\\boxed{")
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def _needs_number(answer: str) -> str | None:
    return None if numbers(answer) else "has no number to compare with"


@register_verifier("exact")
def exact(completion: str, answer: str) -> float:
    """1.0 when the completion equals the answer after :func:`normalize`, else 0.0."""
    return float(normalize(completion) == normalize(answer))


@register_verifier("numeric", ToleranceOptions, answer_error=_needs_number)
def numeric(completion: str, answer: str, rel_tol: float = 1e-6, abs_tol: float = 0.0) -> float:
    """1.0 when the last number of the completion equals the last number of the answer (within
    ``rel_tol`` / ``abs_tol``), else 0.0; 0.0 when either has no number."""
    got, want = last_number(completion), last_number(answer)
    if got is None or want is None:
        return 0.0
    return float(same_number(got, want, rel_tol, abs_tol))


@register_verifier("boxed", ToleranceOptions)
def boxed(completion: str, answer: str, rel_tol: float = 1e-6, abs_tol: float = 0.0) -> float:
    """1.0 when the content of the completion's last ``\\boxed{...}`` matches the answer, else 0.0.

    It matches when :func:`exact` says so, or when both it and the answer hold exactly one
    number and those are equal within the tolerances (``\\boxed{19 apples}`` for ``19``, but not
    ``\\boxed{3, 19}``). An answer written as ``\\boxed{...}`` itself is compared by its content.
    """
    got = boxed_content(completion)
    if got is None:
        return 0.0
    inner = boxed_content(answer)
    want = answer if inner is None else inner
    if exact(got, want):
        return 1.0
    a, b = numbers(got), numbers(want)
    return float(len(a) == 1 and len(b) == 1 and same_number(a[0], b[0], rel_tol, abs_tol))


def load_verifier(name: str, options: dict[str, Any] | None = None) -> Verify:
    """The verifier ``name`` (a built-in name or ``package.module:function``) with its options bound.

    Raises:
        ValueError: one line naming the problem and the fix (an unknown name, an import path that
            does not import or is not a function of ``(completion, answer)``, bad options).
    """
    if ":" in name:
        fn = _user_verifier(name)
        check_options(name, options)
        return fn
    spec = _builtin(name)
    return functools.partial(spec.fn, **_options(spec, name, options).model_dump())


def check_name(name: str) -> None:
    """Raise ``ValueError`` (one line) unless ``name`` is a built-in verifier or the import path of
    a function of ``(completion, answer)`` (which this imports)."""
    if ":" in name:
        _user_verifier(name)
    else:
        _builtin(name)


def check_options(name: str, options: dict[str, Any] | None) -> None:
    """Raise ``ValueError`` (one line, each problem ``key: why``) unless ``options`` are valid
    options of verifier ``name`` (a user's verifier takes none)."""
    if ":" in name:
        if options:
            raise ValueError(f"{name} is called as fn(completion, answer) and takes no options; remove them "
                             f"(or bind them in your module)")
        return
    _options(_builtin(name), name, options)


def answer_error(name: str) -> Callable[[str], str | None]:
    """The check of reference answers of verifier ``name`` (none for a user's verifier)."""
    return (lambda answer: None) if ":" in name else _builtin(name).answer_error


def _builtin(name: str) -> Verifier:
    try:
        return VERIFIERS.get(name)
    except KeyError as e:
        raise ValueError(e.args[0]) from None


def _options(spec: Verifier, name: str, options: dict[str, Any] | None) -> BaseModel:
    try:
        return spec.Config.model_validate(options or {})
    except ValidationError as e:
        valid = ", ".join(spec.Config.model_fields) or "none"
        problems = [f"unknown key {'.'.join(map(str, err['loc']))!r} (valid for verifier {name!r}: {valid})"
                    if err["type"] == "extra_forbidden" else
                    f"{'.'.join(map(str, err['loc']))}: {err['msg']}, got {err['input']!r}"
                    for err in e.errors(include_url=False)]
        raise ValueError("; ".join(problems)) from None


def _user_verifier(path: str) -> Verify:
    try:
        fn = import_path(path)
    except KeyError as e:
        raise ValueError(f"{e.args[0]}; {USER_VERIFIER}") from None
    if not callable(fn):
        raise ValueError(f"{path} is a {type(fn).__name__}, not a function; {USER_VERIFIER}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: it is called with two arguments
        return fn
    try:
        signature.bind("completion", "answer")
    except TypeError as e:
        raise ValueError(f"{path}{signature} cannot be called as fn(completion, answer) ({e}); "
                         f"{USER_VERIFIER}") from None
    return fn
