"""The verifiers of the ``dataset`` env on hand-written cases, and a user's verifier by import path."""

from decimal import Decimal

import pytest

from xrlhf.envs.verifiers import (VERIFIERS, boxed, boxed_content, check_name, check_options, exact, last_number,
                                  load_verifier, normalize, numeric)


@pytest.mark.parametrize("text, normal", [
    ("  Paris ", "paris"),
    ("New   York\n City.", "new york city"),
    ("Yes!!", "yes"),
    ("3.5", "3.5"),
    ("done .", "done"),
    ("STRASSE", "strasse"),
    ("Straße", "strasse"),  # casefold, not lower
])
def test_normalize(text, normal):
    assert normalize(text) == normal


@pytest.mark.parametrize("completion, answer, reward", [
    ("Paris", "paris", 1.0),
    ("  paris.  ", "Paris", 1.0),
    ("the  answer\tis   A", "The answer is A!", 1.0),
    ("Paris, France", "Paris", 0.0),
    ("19", "19.0", 0.0),  # text, not numbers
    ("", "x", 0.0),
])
def test_exact(completion, answer, reward):
    assert exact(completion, answer) == reward


@pytest.mark.parametrize("text, number", [
    ("Tom has 12 + 7 = 19 apples.", "19"),
    ("It costs $1,234.50 in total", "1234.50"),
    ("a loss of -$5", "-5"),
    ("x = -3", "-3"),
    ("7-2", "2"),  # a minus between digits is not a sign
    ("5km, then 12 km", "12"),
    ("50%", "50"),
    ("just .5 of it", "0.5"),
    ("2e3 grains", "2000"),
    ("1,2,3", "3"),  # not thousands groups: three numbers
    ("v1.2.3", None),  # part of a word
    ("no digits here", None),
])
def test_last_number(text, number):
    assert last_number(text) == (None if number is None else Decimal(number))


@pytest.mark.parametrize("completion, answer, options, reward", [
    ("So 12 + 7 = 19. The answer is 19", "19", {}, 1.0),
    ("The answer is 19.", "19", {}, 1.0),
    ("19 apples", "19", {}, 1.0),
    ("$1,000", "1000", {}, 1.0),
    ("1000", "$1,000.00", {}, 1.0),
    ("19 then 20", "19", {}, 0.0),  # the last number counts
    ("nineteen", "19", {}, 0.0),
    ("0.3333", "1/3", {}, 0.0),  # 1/3 is two numbers; the last is 3
    ("3.14159", "3.1416", {}, 0.0),  # default rel_tol 1e-6
    ("3.14159", "3.1416", {"rel_tol": 1e-4}, 1.0),
    ("100.4", "100", {"abs_tol": 0.5}, 1.0),
    ("100.6", "100", {"abs_tol": 0.5}, 0.0),
    ("12345678901234567891", "12345678901234567890", {"rel_tol": 0.0}, 0.0),  # exact beyond float precision
    ("12345678901234567890", "12345678901234567890", {"rel_tol": 0.0}, 1.0),
    ("1e9999999", "2e9999999", {}, 0.0),  # beyond decimal's range: only equal numbers are close
    ("1e9999999", "1e9999999", {}, 1.0),
])
def test_numeric(completion, answer, options, reward):
    assert numeric(completion, answer, **options) == reward
    assert load_verifier("numeric", options)(completion, answer) == reward


@pytest.mark.parametrize("text, content", [
    ("so \\boxed{19}.", "19"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{{a}{b}} done", "{a}{b}"),
    ("\\boxed{}", ""),
    ("\\boxed{1} and \\boxed{2", None),  # the last one is cut off
    ("no box 19", None),
])
def test_boxed_content(text, content):
    assert boxed_content(text) == content


@pytest.mark.parametrize("completion, answer, reward", [
    ("12 + 7 = 19, so \\boxed{19}", "19", 1.0),
    ("\\boxed{19 apples}", "19", 1.0),  # one number each: compared as numbers
    ("\\boxed{$1,000}", "1000", 1.0),
    ("\\boxed{Paris.}", "paris", 1.0),  # exact after normalisation
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{2}}", 1.0),  # an answer written boxed: its content
    ("\\boxed{3, 19}", "19", 0.0),  # two numbers: not a numeric match
    ("the answer is 19", "19", 0.0),  # no box
    ("\\boxed{18} \\boxed{19", "19", 0.0),  # the last box is cut off
    ("\\boxed{0.5}", "1/2", 0.0),
])
def test_boxed(completion, answer, reward):
    assert boxed(completion, answer) == reward


def test_boxed_tolerance_option():
    assert load_verifier("boxed", {"abs_tol": 0.01})("\\boxed{3.141}", "3.14") == 1.0
    assert load_verifier("boxed")("\\boxed{3.141}", "3.14") == 0.0


def test_built_ins_are_registered_and_options_validated():
    assert VERIFIERS.names() == ["boxed", "exact", "numeric"]
    with pytest.raises(ValueError, match=r"unknown verifier 'nope'; valid: boxed, exact, numeric"):
        load_verifier("nope")
    with pytest.raises(ValueError, match=r"unknown key 'tol' \(valid for verifier 'numeric': rel_tol, abs_tol\)"):
        check_options("numeric", {"tol": 1})
    with pytest.raises(ValueError, match=r"rel_tol: Input should be greater than or equal to 0, got -1"):
        check_options("boxed", {"rel_tol": -1})
    with pytest.raises(ValueError, match=r"unknown key 'rel_tol' \(valid for verifier 'exact': none\)"):
        check_options("exact", {"rel_tol": 0.1})


USER_MODULE = '''
def contains(completion: str, answer: str) -> float:
    return float(answer in completion)

def three(completion, answer, extra):
    return 1.0

NOT_CALLABLE = 42

raise_on_import = False
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_verifiers_mod.py").write_text(USER_MODULE)
    (tmp_path / "broken_verifiers_mod.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_verifiers_mod"


def test_a_user_verifier_by_import_path(user_module):
    verify = load_verifier(f"{user_module}:contains")
    assert verify("it is 19 apples", "19") == 1.0 and verify("18", "19") == 0.0
    check_name(f"{user_module}:contains")
    with pytest.raises(ValueError, match=r"takes no options; remove them"):
        load_verifier(f"{user_module}:contains", {"rel_tol": 0.1})


@pytest.mark.parametrize("path, message", [
    ("no_such_verifier_mod:f", r"cannot import module 'no_such_verifier_mod' of 'no_such_verifier_mod:f': No module "),
    ("my_verifiers_mod:missing", r"module 'my_verifiers_mod' has no attribute 'missing'"),
    ("my_verifiers_mod:NOT_CALLABLE", r"my_verifiers_mod:NOT_CALLABLE is a int, not a function"),
    ("my_verifiers_mod:three", r"my_verifiers_mod:three\(completion, answer, extra\) cannot be called as "
                               r"fn\(completion, answer\)"),
    ("broken_verifiers_mod:f", r"SyntaxError: .*broken_verifiers_mod.py, line 1\); fix the file"),
])
def test_a_bad_user_verifier_is_one_line_with_the_fix(user_module, path, message):
    with pytest.raises(ValueError, match=message) as e:
        load_verifier(path)
    text = str(e.value)
    assert "\n" not in text
    assert text.endswith("with the signature (completion: str, answer: str) -> float")
