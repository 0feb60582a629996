"""No trainer reads the whole config: ``self.cfg`` appears nowhere in ``xrlhf/algorithms``. A
trainer receives its own options, a ``RunSpec`` and its parts from ``algorithms.build.build_trainer``
(STYLE 19; docs/design/composition.md, stage 5)."""

import ast
from pathlib import Path

import xrlhf.algorithms

ROOT = Path(xrlhf.algorithms.__file__).parent


def test_no_self_cfg_in_algorithms():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "cfg" and isinstance(node.value, ast.Name)
                    and node.value.id == "self"):
                found.append(f"{path.relative_to(ROOT.parent.parent)}:{node.lineno}")
    assert not found, "self.cfg in the algorithm layer; take it from RunSpec or a part (build.py):\n" + "\n".join(found)
