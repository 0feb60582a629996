"""The one home of xrlhf's uses of other libraries' private names, and of its process tricks.

Each use is a ``Hook``: what it buys, the package and the releases it was checked on, and the
public path that runs without it. A hook runs only where it is *active*:

* not switched off: ``XRLHF_PUBLIC_ONLY=1`` switches every hook off (``xrlhf run --public-only``),
  ``XRLHF_HOOKS_OFF=name,name`` some of them;
* its package's installed release inside the range it was checked on;
* its probe finding what it needs (the private names still there).

Outside the range, or where the names moved, the public path runs and one warning line per
process says what is lost. Nothing outside this package reads or writes another library's private
name, patches another module, or plays a process trick (``tests/internals/test_gate.py`` checks
the AST of every module); ``docs/internals.md`` lists the hooks and what each buys.

The submodules import their library only inside functions, so importing one costs nothing and
the layers keep their rules (engines import no Ray: ``internals.ray`` imports it when called).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Callable

from loguru import logger

from xrlhf.utils.versions import installed, release

PUBLIC_ONLY = "XRLHF_PUBLIC_ONLY"
"""Set to 1: every hook off, xrlhf runs on its dependencies' public APIs only."""
HOOKS_OFF = "XRLHF_HOOKS_OFF"
"""A comma-separated list of hook names switched off (``xrlhf hooks`` lists them)."""
SWITCHES = (PUBLIC_ONLY, HOOKS_OFF)
"""The variables a run hands to its workers, so that every process agrees on the hooks."""

MODULES = ("process", "ray", "torch", "vllm", "vllm_record")
"""The submodules that declare hooks (``all_hooks`` imports them)."""


def _no_probe() -> str | None:
    return None


def needs(module: str, *names: str) -> Callable[[], str | None]:
    """A probe: ``module`` imports and has each of ``names`` (dotted below it: ``"Node.start_monitor"``)."""
    def probe() -> str | None:
        missing = []
        for name in names:
            obj = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                missing.append(name)
        return f"{module} has no {', '.join(missing)}" if missing else None
    return probe


@dataclass(frozen=True)
class Hook:
    """One use of a library's internals (or a process trick) and its public fallback.

    Attributes:
        name: ``package.what``, the name ``XRLHF_HOOKS_OFF`` takes.
        package: the distribution whose internals it uses (``"python"``: the standard library).
        checked: the lowest and highest ``major.minor`` releases it was checked on, inclusive.
        buys: what it buys, one line (the measured figures are in docs/internals.md).
        without: what runs without it (the public path), one line.
        probe: returns why the internals cannot be used here (``None``: they can); called once
            per process, when the hook is first asked, with the package already imported by then.
    """

    name: str
    package: str
    checked: tuple[str, str]
    buys: str
    without: str
    probe: Callable[[], str | None] = field(default=_no_probe, compare=False, repr=False)

    def __post_init__(self):
        if self.name in HOOKS:
            raise ValueError(f"hook {self.name!r} is declared twice")
        HOOKS[self.name] = self

    def switched_off(self) -> bool:
        """Whether the environment switches this hook off (read on every call: tests set it)."""
        if os.environ.get(PUBLIC_ONLY, "") not in ("", "0"):
            return True
        return self.name in {n.strip() for n in os.environ.get(HOOKS_OFF, "").split(",")}

    def out_of_range(self) -> str | None:
        """Why the installed release is not one this hook was checked on (``None``: it is)."""
        version = installed(self.package)
        if version is None:
            return f"{self.package} is not installed"
        low, high = (release(v) for v in self.checked)
        if not low <= release(version) <= high:
            return (f"it was checked on {self.package} {self.checked[0]} to {self.checked[1]}, this is "
                    f"{self.package} {version}")
        return None

    def active(self) -> bool:
        """Whether to use the internals now; the first time it is not for a reason other than a
        switch, one warning line says what is lost."""
        if self.switched_off():
            return False
        why = _why_not(self.name)
        if why is not None and self.name not in _WARNED:
            _WARNED.add(self.name)
            logger.warning(f"{self.name} is off ({why}): {self.without}; see docs/internals.md")
        return why is None

    def status(self) -> str:
        """One word or phrase for ``xrlhf hooks``: on, off by a switch, or why it is off."""
        if self.switched_off():
            return "off (switched off)"
        why = _why_not(self.name)
        return "on" if why is None else f"off ({why})"


HOOKS: dict[str, Hook] = {}
"""Every hook declared so far, by name (``all_hooks`` imports every declaring module)."""
_WARNED: set[str] = set()
_CHECKED: dict[str, str | None] = {}


def _why_not(name: str) -> str | None:
    """The range and the probe of hook ``name``, once per process."""
    if name not in _CHECKED:
        hook = HOOKS[name]
        why = hook.out_of_range()
        if why is None:
            try:
                why = hook.probe()
            except Exception as e:  # noqa: BLE001 - a probe that breaks is a library that moved
                why = f"its probe failed: {type(e).__name__}: {e}"
        _CHECKED[name] = why
    return _CHECKED[name]


def forget() -> None:
    """Check every hook's range and probe again at its next use (after a package was installed,
    or a test put a stand-in in its place)."""
    _CHECKED.clear()
    _WARNED.clear()


def all_hooks() -> dict[str, Hook]:
    """Every hook of xrlhf, by name (imports the declaring modules: cheap, no library loads)."""
    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")
    return dict(sorted(HOOKS.items()))


def switches() -> dict[str, str]:
    """The hook switches set in this process's environment, for its workers' environment."""
    return {k: os.environ[k] for k in SWITCHES if k in os.environ}


def unknown_switched_off() -> list[str]:
    """Names in ``XRLHF_HOOKS_OFF`` that are no hook (a typo would switch nothing off)."""
    names = [n.strip() for n in os.environ.get(HOOKS_OFF, "").split(",") if n.strip()]
    known = all_hooks()
    return [n for n in names if n not in known]


def table() -> str:
    """Every hook as a Markdown table: name, what it buys, the releases checked, the one installed,
    and whether it is on here (``xrlhf hooks``)."""
    rows = ["| hook | buys | checked on | here | status |", "|---|---|---|---|---|"]
    for name, hook in all_hooks().items():
        rows.append(f"| {name} | {hook.buys} | {hook.package} {hook.checked[0]}-{hook.checked[1]} | "
                    f"{installed(hook.package) or 'absent'} | {hook.status()} |")
    unknown = unknown_switched_off()
    if unknown:
        rows.append(f"\n{HOOKS_OFF} names no hook called {', '.join(unknown)}")
    return "\n".join(rows)
