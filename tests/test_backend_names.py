"""Nothing outside a backend tests a backend's name (STYLE principle 12; docs/extending.md).

What the planner, the fork server or the coordinator need of a backend is a hook on its engine
class (``engines.base.Engine``), so a backend a user registers gets the same treatment from its own
class. Read from the AST of every module of xrlhf outside the backends' own files: a comparison
(``==``, ``!=``, ``in``, ``not in``, ``is``) with a backend's name, or a lookup keyed by one
(``d["vllm"]``, ``d.get("vllm")``), is reported as file:line. A name as data is fine: a config
default (``engine: str = "hf"``), a record's default, a registration (``"vllm.generate"``), the
library gate's tables (``xrlhf/internals``: ``"vllm"`` there is the package, not the backend).
"""

from __future__ import annotations

import ast
from pathlib import Path

import xrlhf
from xrlhf.engines.base import engine_names

ROOT = Path(xrlhf.__file__).parent
BACKENDS = ("engines/hf", "engines/deepspeed", "engines/vllm")
"""The backends' own files, which may test their names (their checkpoint format, their package)."""
SKIP = ("internals",)
"""The library gate: one module per library, named as the package it gates."""


def backend_names() -> set[str]:
    """Every registered backend's name (``hf``, ``deepspeed``, ``vllm``, ...)."""
    return {n for role in ("train", "infer", "generate") for n in engine_names(role)}


def _names_in(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` is a backend's name, or a tuple, list or set literal holding one."""
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e, names) for e in node.elts)
    return False


def _lookup_key(node: ast.AST) -> ast.AST | None:
    """The key of a lookup: ``d[key]``, ``d.get(key)`` (``pop``, ``setdefault``); ``None`` otherwise."""
    if isinstance(node, ast.Subscript):
        return node.slice
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault") and node.args):
        return node.args[0]
    return None


def name_tests(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` of every comparison with, or lookup keyed by, a backend's name in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_in(n, names) for n in [node.left, *node.comparators]):
            out.append((node.lineno, "compares with a backend's name"))
        elif _lookup_key(node) is not None and _names_in(_lookup_key(node), names):
            out.append((node.lineno, "looks up by a backend's name"))
    return out


def checked_files() -> list[Path]:
    """Every module of xrlhf outside the backends' own files and the library gate."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(BACKENDS) and not rel.startswith(SKIP):
            out.append(path)
    return out


def test_the_checker_sees_name_tests():
    names = {"vllm", "deepspeed"}
    src = ('a = engine == "vllm"\nb = g.engine != "deepspeed"\nc = e in ("hf", "vllm")\nd = table["vllm"]\n'
           'e = table.get("deepspeed")\nf: str = "vllm"\ng = register("vllm.generate")\n')
    assert [line for line, _ in name_tests(ast.parse(src), names)] == [1, 2, 3, 4, 5]


def test_no_module_outside_a_backend_tests_a_backends_name():
    names = backend_names()
    assert {"hf", "deepspeed", "vllm"} <= names
    found = [f"xrlhf/{p.relative_to(ROOT).as_posix()}:{line}: {what}"
             for p in checked_files() for line, what in name_tests(ast.parse(p.read_text(), str(p)), names)]
    assert not found, ("ask the engine class instead (a hook on engines.base.Engine, docs/extending.md):\n"
                       + "\n".join(found))
