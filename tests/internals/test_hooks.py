"""``xrlhf.internals``'s hooks: the switches, the checked range, the probes, the one warning.

``test_each_hook_finds_what_it_needs`` is the test that fails loudly when a library moves: for
every hook whose package is installed here, its probe must find the private names it uses,
whatever the release (on the GPU machine, with vLLM installed, the vLLM hooks' probes run too:
tests/gpu/test_vllm_engine.py runs this module's check there).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from loguru import logger

from xrlhf import internals
from xrlhf.internals import HOOKS_OFF, PUBLIC_ONLY, Hook
from xrlhf.utils.versions import installed, pinned, release


@pytest.fixture
def fresh(monkeypatch):
    """Hooks checked anew and warnings collected; the switches unset."""
    monkeypatch.delenv(PUBLIC_ONLY, raising=False)
    monkeypatch.delenv(HOOKS_OFF, raising=False)
    internals.forget()
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    yield lines
    logger.remove(sink)
    internals.forget()


@pytest.fixture(autouse=True)
def no_test_hooks_left():
    """Hooks a test declares (``test.*``) leave the registry with it."""
    yield
    for name in [n for n in internals.HOOKS if n.startswith("test.")]:
        del internals.HOOKS[name]


def _hook(name: str, **kw) -> Hook:
    kw.setdefault("package", "python")
    kw.setdefault("checked", ("3.0", "3.99"))
    return Hook(name, buys="speed", without="the public path", **kw)


@pytest.mark.parametrize("name", sorted(internals.all_hooks()))
def test_each_hook_finds_what_it_needs(name):
    hook = internals.all_hooks()[name]
    if installed(hook.package) is None:
        pytest.skip(f"{hook.package} is not installed here")
    assert hook.probe() is None, f"{name}: {hook.package} {installed(hook.package)} moved; update the hook"


def test_every_hook_is_described_and_named_after_its_package():
    for name, hook in internals.all_hooks().items():
        assert name.split(".")[0] in (hook.package, "process"), name
        assert hook.buys and hook.without and release(hook.checked[0]) <= release(hook.checked[1]), name


def test_public_only_and_hooks_off_switch_hooks_off_without_a_warning(fresh, monkeypatch):
    a, b = _hook("test.a"), _hook("test.b")
    assert a.active() and b.active()
    monkeypatch.setenv(HOOKS_OFF, "test.b, other")
    assert a.active() and not b.active() and b.status() == "off (switched off)"
    monkeypatch.setenv(PUBLIC_ONLY, "1")
    assert not a.active() and not b.active()
    monkeypatch.setenv(PUBLIC_ONLY, "0")  # 0 means on
    assert a.active()
    assert fresh == []


def test_outside_its_range_a_hook_falls_back_with_one_warning(fresh):
    old = _hook("test.old", checked=("2.0", "2.7"))
    assert not old.active() and not old.active()
    assert len(fresh) == 1
    assert "test.old is off (it was checked on python 2.0 to 2.7, this is python" in fresh[0]
    assert "the public path" in fresh[0]
    missing = _hook("test.absent", package="no-such-package-xrlhf")
    assert not missing.active() and missing.status() == "off (no-such-package-xrlhf is not installed)"


def test_a_probe_that_fails_or_breaks_turns_the_hook_off(fresh):
    moved = _hook("test.moved", probe=lambda: "lib has no _thing")
    broken = _hook("test.broken", probe=lambda: 1 / 0)
    assert not moved.active() and not broken.active()
    assert "test.moved is off (lib has no _thing)" in fresh[0]
    assert "its probe failed: ZeroDivisionError" in fresh[1]


def test_a_name_is_declared_once():
    _hook("test.twice")
    with pytest.raises(ValueError, match="declared twice"):
        Hook("test.twice", "python", ("3.0", "3.99"), buys="x", without="y")


def test_versions_by_major_and_minor_release():
    assert release("2.14.0+cu130") == (2, 14) and release("0.33.0rc1") == (0, 33) and release("5") == (5, 0)
    assert installed("python") == ".".join(map(str, sys.version_info[:3]))
    assert installed("no-such-package-xrlhf") is None
    assert pinned("no-such-package-xrlhf", "torch") is None


def test_unknown_names_in_hooks_off_are_a_config_error(monkeypatch, tiny_model):
    from xrlhf.utils.errors import UserError
    from xrlhf.validation import load_config

    monkeypatch.setenv(HOOKS_OFF, "ray.worker_niceness,ray.workerniceness")
    with pytest.raises(UserError) as e:
        load_config("configs/quickstart.yaml", [f"policy.model={tiny_model}"])
    assert f"{HOOKS_OFF}: no hook is called 'ray.workerniceness'; xrlhf hooks lists them" in e.value.messages


def test_the_cli_lists_the_hooks_and_switches_them_off():
    out = subprocess.run([sys.executable, "-m", "xrlhf.cli", "hooks"], capture_output=True, text=True, timeout=300,
                         env=_env())
    assert out.returncode == 0, out.stderr
    assert "| ray.worker_niceness |" in out.stdout and "| on |" in out.stdout
    for switch in (["--public-only"], []):
        env = _env() if switch else {**_env(), PUBLIC_ONLY: "1"}
        out = subprocess.run([sys.executable, "-m", "xrlhf.cli", "hooks", *switch], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0 and "off (switched off)" in out.stdout and "| on |" not in out.stdout, out


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in (PUBLIC_ONLY, HOOKS_OFF)}


def test_an_engine_refuses_releases_it_was_not_checked_on(monkeypatch):
    """``Engine.supported``: another release, or a torch other than the one the package pins, is one line."""
    from xrlhf.engines import base

    class Old(base.Engine):
        supported = {"python": ("2.7",)}

    class Pinned(base.Engine):
        supported = {"fakelib": ("1.0", "1.2")}

    assert Old.version_errors() == [f"python {installed('python')} is not supported; it runs on python 2.7: "
                                    "pip install -e '.[python]'"]
    versions = {"fakelib": "1.2.3", "torch": "2.11.0+cu130"}
    monkeypatch.setattr(base, "installed", versions.get)
    monkeypatch.setattr(base, "pinned", lambda package, dep: "2.14.0")
    assert Pinned.version_errors() == ["fakelib 1.2.3 needs torch 2.14.0, this is torch 2.11.0+cu130: "
                                       "pip install torch==2.14.0"]
    versions["torch"] = "2.14.0+cu130"
    assert Pinned.version_errors() == []
    versions["fakelib"] = "1.3.0"
    assert Pinned.version_errors()[0].startswith("fakelib 1.3.0 is not supported; it runs on fakelib 1.0 or 1.2")


def test_needs_names_what_a_module_lacks():
    from xrlhf.internals import needs

    assert needs("importlib.metadata", "version", "PackageNotFoundError.args")() is None
    assert needs("importlib.metadata", "version", "_no_such", "Distribution._nope")() == \
        "importlib.metadata has no _no_such, Distribution._nope"
    with pytest.raises(ModuleNotFoundError):  # Hook.active reports a probe that raises as failed
        needs("no_such_module_xrlhf", "x")()
