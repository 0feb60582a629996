"""The gate of ``xrlhf.internals``: no module outside it reads or writes another library's private
name, patches another module, or plays a process trick. Read from the AST of every module, so a
new use fails here whatever its name:

* a private module or name of another package (``import torch._dynamo``, ``from x import _y``,
  ``torch._C.f``, ``vllm.a._b``): any dotted segment that starts with ``_`` (dunders apart);
* a private attribute of any object that xrlhf itself does not define (``handle._actor_id``,
  ``config._attn_implementation``), also through ``getattr``/``hasattr``/``setattr`` with a string;
* a write into another module (``importlib.metadata.f = ...``, ``setattr(module, ...)``), into
  ``sys.modules``, or into an object's ``__class__``.

Documented names that look private or are meant to be written are allowed by name (``PUBLIC``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "xrlhf"
GATE = PACKAGE / "internals"

PUBLIC = {"os._exit", "sys.argv", "sys.unraisablehook", "sys.excepthook", "sys.modules['__main__']"}
"""Documented as public although they look private, or documented as writable."""


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _own_names(trees: dict[Path, ast.AST]) -> set[str]:
    """Every name xrlhf itself defines: functions, classes, attributes it assigns, arguments."""
    own: set[str] = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
            elif isinstance(n, ast.arg):
                own.add(n.arg)
            elif isinstance(n, ast.alias):
                own.add((n.asname or n.name).split(".")[0])
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr" and \
                    len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
                own.add(n.args[1].value)
    return own


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name of another package's module (or attribute) it is bound to,
    by import or by ``sys.modules.get("x")`` / ``importlib.import_module("x")``."""
    alias: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] != "xrlhf":
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] != "xrlhf":
            for a in n.names:
                alias[a.asname or a.name] = f"{n.module}.{a.name}"
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) and \
                isinstance(n.value, ast.Call) and n.value.args and isinstance(n.value.args[0], ast.Constant):
            call = ast.unparse(n.value.func)
            if call in ("sys.modules.get", "importlib.import_module") and isinstance(n.value.args[0].value, str) \
                    and not n.value.args[0].value.startswith("xrlhf"):
                alias[n.targets[0].id] = n.value.args[0].value
    return alias


def _dotted(node: ast.AST, alias: dict[str, str]) -> str | None:
    """``node`` as another package's dotted name (``torch.cuda._x``), or ``None``."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in alias:
        return ".".join([alias[node.id], *reversed(chain)])
    return None


def violations(path: Path, tree: ast.AST, own: set[str]) -> list[str]:
    """What ``tree`` (the module at ``path``) does that belongs behind the gate."""
    alias, found = _aliases(tree), []

    def hit(node: ast.AST, what: str) -> None:
        if what not in PUBLIC:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {what}")

    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] != "xrlhf" and any(map(_private, a.name.split("."))):
                    hit(n, f"import {a.name}")
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] != "xrlhf":
            if any(map(_private, n.module.split("."))) or any(_private(a.name) for a in n.names):
                hit(n, f"from {n.module} import {', '.join(a.name for a in n.names)}")
        elif isinstance(n, ast.Attribute):
            dotted = _dotted(n, alias)
            if dotted is not None and isinstance(n.ctx, ast.Load) and _private(n.attr):
                hit(n, dotted)
            elif _private(n.attr) and n.attr not in own:
                hit(n, ast.unparse(n))
            if isinstance(n.ctx, (ast.Store, ast.Del)):
                if dotted is not None and dotted not in PUBLIC:
                    hit(n, f"{dotted} written")
                elif n.attr == "__class__":
                    hit(n, f"{ast.unparse(n)} written")
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)) and \
                ast.unparse(n.value) == "sys.modules":
            hit(n, ast.unparse(n))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and len(n.args) > 1 and \
                n.func.id in ("getattr", "hasattr", "setattr", "delattr"):
            name = n.args[1].value if isinstance(n.args[1], ast.Constant) else None
            if isinstance(name, str) and _private(name) and name not in own:
                hit(n, f"{n.func.id}(..., {name!r})")
            if n.func.id in ("setattr", "delattr") and _dotted(n.args[0], alias) is not None:
                hit(n, f"{n.func.id}({ast.unparse(n.args[0])}, ...)")
    return found


def _trees() -> dict[Path, ast.AST]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_private_name_or_patch_outside_the_gate():
    trees = _trees()
    own = _own_names(trees)
    found = [v for p, t in trees.items() if GATE not in p.parents for v in violations(p, t, own)]
    assert not found, "these belong in xrlhf/internals/ (a Hook with its versions and fallback):\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_use():
    """Each rule on a module written for the purpose (so a rule that stops working fails here)."""
    source = '''
import torch
import torch._dynamo
import importlib.metadata
import os
import sys
from vllm.model_executor.models import registry
from transformers.utils import _private_helper
t = sys.modules.get("torch")
torch._C._set_sm_carveout_experimental(3)
t.cuda._is_in_bad_fork()
registry._run_in_subprocess = None
importlib.metadata.entry_points = None
sys.modules["ray"] = None
handle._actor_id
getattr(config, "_attn_implementation")
setattr(registry, "f", None)
obj.__class__ = object
os._exit(0)
sys.argv = ["x"]
self._mine
'''
    tree = ast.parse(source)
    found = violations(PACKAGE / "example.py", tree, own={"_mine"})
    expected = ["import torch._dynamo", "from transformers.utils import _private_helper",
                "torch._C._set_sm_carveout_experimental", "torch.cuda._is_in_bad_fork",
                "vllm.model_executor.models.registry._run_in_subprocess written", "importlib.metadata.entry_points written",
                "sys.modules['ray']", "handle._actor_id", "getattr(..., '_attn_implementation')",
                "setattr(registry, ...)", "obj.__class__ written"]
    for what in expected:
        assert any(line.endswith(": " + what) for line in found), (what, found)
    assert not any("os._exit" in f or "sys.argv" in f or "_mine" in f for f in found), found
