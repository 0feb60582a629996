"""Docstrings say what and why; measurements live in docs/ (issue 52). Read from the AST of every
module in xrlhf/: no docstring (module, class, function, or the string under an assignment) and
no comment names a GPU model, a date, or the benchmark workload W (W2, W7) as a measurement. A
GPU named inside ``double backticks`` is a code value (``--gpu-kind h100``), not a card.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "xrlhf"

PENDING: set[str] = set()  # files skipped while another change edits them (none now)

GPU = re.compile(r"\b[AaHh]100\b|\b[Hh]200\b|\b[Hh]20\b|\b[Bb]200\b|\b[Ll]40S?\b")
MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December|"
          "Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec")
DATE = re.compile(rf"\b20\d\d-\d\d-\d\d\b|\b(?:{MONTHS})\.? (?:\d{{1,2}},? )?20\d\d\b")
# The workload: "W2"/"W7" anywhere, "W's ...", "on W", "of W", "workload W", "(W:", "W on one/an".
# Not a weight matrix W (``W x + b``, ``W``'s dtype, "W + alpha / r * B A").
WORKLOAD = re.compile(r"(?<![`\w])(?:W[27](?![\w`])|W(?='s\b)|(?<=\bon |\bof )W(?![\w`])|(?<=workload )W\b|"
                      r"(?<=\()W(?=[:)])|W(?= on (?:one|an?)\b))")
CODE = re.compile(r"``.*?``", re.DOTALL)


def _docstrings(tree: ast.Module):
    """(line, text) of every docstring: a module's, class's or function's first string, and the
    string right under an assignment (an attribute's or constant's docstring)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                continue
            first = i == 0 and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            if first or (i > 0 and isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))):
                yield stmt.lineno, stmt.value.value


def _mask_code(text: str) -> str:
    """``code`` spans blanked, their line breaks kept (so the lines still count)."""
    return CODE.sub(lambda m: "``" + "\n" * m.group().count("\n") + "``", text)


def _comments(source: str):
    """(line, text) of every comment."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def offences(path: Path) -> list[str]:
    found = []
    source = path.read_text()
    for line, text in [*_docstrings(ast.parse(source, str(path))), *_comments(source)]:
        for k, (row, bare) in enumerate(zip(text.splitlines(), _mask_code(text).splitlines())):
            for what, rx, where in (("GPU model", GPU, bare), ("date", DATE, row), ("workload", WORKLOAD, bare)):
                if rx.search(where):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{line + k}: {what}: {row.strip()}")
    return found


def test_no_card_date_or_workload_in_docstrings():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE.parent).as_posix() not in PENDING:
            found += offences(path)
    assert not found, "measurements belong in docs/, not in docstrings or comments:\n" + "\n".join(found)


def test_patterns():
    for text in ("on one H100", "an h200", "A100 of 80 GB", "B200", "L40S", "2026-11-28", "November 2026",
                 "Nov 28, 2026"):
        assert GPU.search(text) or DATE.search(text), text
    for text in ("W's warm start", "on W (vocab 32k)", "W2 compiled", "workload W", "(W: 0.39 GiB)",
                 "W on one H200", "models of W stop", "7B model (W7)"):
        assert WORKLOAD.search(text), text
    for text in ("``W x + alpha / r * B A x``", "(W + alpha/r B A)", "``W``'s dtype", "W and b", "GPT-2",
                 "the H2D copy", "MAY be set", "100 steps", "an A1 grade", "``--gpu-kind h100``"):
        assert not (WORKLOAD.search(text) or DATE.search(text) or GPU.search(_mask_code(text))), text
