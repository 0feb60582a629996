"""The import graph of xrlhf, read from the source (every ``import``, at module level or inside a
function, ``TYPE_CHECKING`` ones too): no arrow goes up a layer, no circle, no private name of
another module. tests/test_layers.py checks what importing a layer loads; this one sees the
imports a function makes only when it runs."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import xrlhf

ROOT = Path(xrlhf.__file__).parent

LAYERS: dict[str, int] = {
    "utils": 0,
    "config": 1, "data": 1, "internals": 1, "models": 1, "checkpoint": 1,
    "weight_sync": 2,
    "engines": 3,
    "coordinator": 4,
    "algorithms": 5, "envs": 5, "tools": 5,
    "runner": 6, "validation": 6, "completions": 6, "report": 6, "rundir": 6,
    "tracking": 6, "resolved": 6, "topology": 6, "plan": 6,
    "cli": 7,
}
"""Each top-level module or package of xrlhf and its layer (docs/architecture.md): a module may
import its own layer and those below. 0-1: leaves (``checkpoint``: the checkpoint directory's
files, which the warm-up writes too); 2-3: engines and their transports; 4: the
coordinator; 5: algorithms, envs, tools; 6: the shell; 7: the command line."""


def modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` for every module of xrlhf."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


MODULES = modules()


def imports(name: str) -> list[tuple[int, str, str | None]]:
    """``(line, module imported, name imported from it or None)`` for every xrlhf import of module
    ``name``; ``from a import b`` where ``a.b`` is a module counts as an import of ``a.b``."""
    path, package = MODULES[name]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "xrlhf"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if package else name.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] != "xrlhf":
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((node.lineno, full, None) if full in MODULES else (node.lineno, base, a.name))
    return out


def top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_every_module_has_a_layer():
    assert {top(m) for m in MODULES if m != "xrlhf"} <= set(LAYERS), \
        f"give {sorted({top(m) for m in MODULES if m != 'xrlhf'} - set(LAYERS))} a layer in LAYERS"


def test_no_import_goes_up_a_layer():
    up = sorted({f"{MODULES[m][0].relative_to(ROOT.parent)}:{line}: {m} (layer {LAYERS[top(m)]}) imports {target} "
          f"(layer {LAYERS[top(target)]})"
          for m in MODULES if m != "xrlhf"
          for line, target, _ in imports(m) if target != "xrlhf" and LAYERS[top(target)] > LAYERS[top(m)]})
    assert not up, "\n".join(up)


def test_no_private_name_of_another_module_is_imported():
    private = []
    for m in MODULES:
        for line, target, name in imports(m):
            leaf = (name or target.rsplit(".", 1)[-1])
            own_package = target.rsplit(".", 1)[0] == (m if MODULES[m][1] else m.rsplit(".", 1)[0])
            if leaf.startswith("_") and not leaf.startswith("__") and target != m and not (name is None and own_package):
                private.append(f"{MODULES[m][0].relative_to(ROOT.parent)}:{line}: {m} imports {target}"
                               + (f".{name}" if name else ""))
    assert not private, "make these public (or move them where they are used):\n" + "\n".join(private)


def test_no_import_circle():
    graph = defaultdict(set)
    for m in MODULES:
        for _, target, _ in imports(m):
            if target in MODULES and target != m and not _is_parent(target, m):
                graph[m].add(target)
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def _is_parent(package: str, module: str) -> bool:
    """``xrlhf.tools`` for ``xrlhf.tools.base``: a package's ``__init__`` re-exports its modules,
    which import their siblings through it; that is no circle of code."""
    return module.startswith(package + ".")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
