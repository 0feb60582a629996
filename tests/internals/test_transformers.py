"""``internals.transformers`` (the hook ``transformers.without_sklearn``): transformers is told scikit-learn is
absent only where its import would be eager; ``internals.imports.cache_entry_points``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A stand-in scikit-learn (the CPU install has none) that records being imported.
FAKE = "import os\nopen(os.environ['SKLEARN_MARK'], 'w').close()\n"

PROBE = """
import json, sys
import xrlhf.internals.transformers as lean
if sys.argv[1] == "old":  # as if this transformers imported scikit-learn eagerly (and the hook was checked on it)
    lean.EAGER_SKLEARN_BEFORE = (99, 0)
    object.__setattr__(lean.WITHOUT_SKLEARN, "checked", ("0.0", "99.0"))
if sys.argv[2] == "imported":
    import sklearn
applied = lean.import_without_sklearn()
import transformers.utils
import transformers.generation.candidate_generator
print(json.dumps({"applied": applied, "seen": transformers.utils.is_sklearn_available(),
                  "seen_by_import_utils": transformers.utils.import_utils.is_sklearn_available()}))
"""


def _probe(tmp_path, version: str, sklearn: str, keep: bool = False) -> tuple[dict, bool]:
    pkg = tmp_path / "site" / "sklearn"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(FAKE)
    mark = tmp_path / f"imported-{version}-{sklearn}-{keep}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.getcwd()]),
           "SKLEARN_MARK": str(mark)}
    env.pop("XRLHF_HOOKS_OFF", None)
    env.pop("XRLHF_PUBLIC_ONLY", None)
    if keep:
        env["XRLHF_HOOKS_OFF"] = "transformers.without_sklearn"
    out = subprocess.run([sys.executable, "-c", PROBE, version, sklearn], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), mark.exists()


def test_an_eager_transformers_is_told_sklearn_is_absent_and_never_imports_it(tmp_path):
    got, imported = _probe(tmp_path, "old", "fresh")
    assert got == {"applied": True, "seen": False, "seen_by_import_utils": False}
    assert not imported


def test_a_lazy_transformers_a_paid_import_and_the_opt_out_keep_transformers_answer(tmp_path):
    got, _ = _probe(tmp_path, "new", "fresh")  # this install's transformers imports it where used
    assert got == {"applied": False, "seen": True, "seen_by_import_utils": True}
    got, _ = _probe(tmp_path, "old", "imported")  # already imported: nothing left to save
    assert got["applied"] is False and got["seen"] is True
    got, imported = _probe(tmp_path, "old", "fresh", keep=True)
    assert got["applied"] is False and got["seen"] is True and not imported


def test_cache_entry_points_answers_as_before_once_per_selection():
    import importlib.metadata as md

    import xrlhf.internals.imports as lean

    before, plain = md.entry_points, lean._ENTRY_POINTS
    md.entry_points = plain  # as in a fresh worker (an EngineWorker built in this process caches it)
    try:
        lean.cache_entry_points()
        assert md.entry_points is not plain
        first = md.entry_points(group="console_scripts")
        assert first == plain(group="console_scripts") and len(first) > 0
        assert md.entry_points(group="console_scripts") is first  # kept
        assert md.entry_points(group="no-such-group-xrlhf") == plain(group="no-such-group-xrlhf")
        cached = md.entry_points
        lean.cache_entry_points()  # a second call changes nothing
        assert md.entry_points is cached and md.entry_points(group="console_scripts") is first
    finally:
        md.entry_points = before
