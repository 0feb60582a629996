"""Tools built from their YAML specs (``{name, options}``): in this process or in a sandboxed
worker (``xrlhf.tools.sandbox``), and every problem of a list of specs, one line each."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xrlhf.tools.base import Tool, tool_class


def build_tool(name: str, options: dict[str, Any] | None = None) -> Tool:
    """The tool ``name`` (registered name or ``pkg.module:Class``) with validated options.

    With ``sandbox: none`` the tool is built here, in this process; otherwise the result is a
    :class:`xrlhf.tools.sandbox.SandboxedTool` that builds it, and runs every call, in a
    sandboxed worker process (started at the first call, or by its ``start()``).

    Raises:
        KeyError: for an unknown name, listing the valid ones.
        TypeError: if ``name`` is not a ``Tool`` subclass.
        ValueError: a sandbox this machine cannot give, or a class a worker cannot import.
        pydantic.ValidationError: for bad options (the caller prefixes the YAML path).
    """
    cls = tool_class(name)
    config = cls.Config.model_validate(options or {})
    if config.sandbox == "none":
        return cls(config)
    from xrlhf.tools.sandbox import SandboxedTool

    return SandboxedTool(cls, config)


class ToolSpec(BaseModel):
    """One entry of an env's ``tools`` list in YAML: ``{name: calculator, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    name: str
    options: dict[str, Any] = Field(default_factory=dict)


def tool_errors(specs: list[dict[str, Any] | ToolSpec], where: str, step_timeout_s: float | None = None) -> list[str]:
    """Every problem of a list of tool specs, one line each, prefixed with ``where`` (the YAML path
    of the list, e.g. ``env.options.tools``). An empty list means the tools can be built.

    Checks: each spec is ``{name, options}``; the name is a known tool; the options validate
    against that tool's ``Config``; no two specs give the model the same tool name; a call's
    ``timeout_s`` is below ``step_timeout_s`` (the turn's limit, which abandons the whole turn:
    a tool's own limit above it would never act).
    """
    errors: list[str] = []
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        if isinstance(spec, ToolSpec):
            spec = spec.model_dump()
        if not isinstance(spec, dict) or "name" not in spec or set(spec) - {"name", "options"}:
            errors.append(f"{at}: expected {{name: <tool>, options: {{...}}}}, got {spec!r}")
            continue
        try:
            cls = tool_class(str(spec["name"]))
        except (KeyError, TypeError) as e:
            errors.append(f"{at}.name: {e.args[0]}")
            continue
        options = spec.get("options") or {}
        try:
            config = cls.Config.model_validate(options)
        except ValidationError as e:
            errors += [f"{at}.options{''.join(f'.{p}' for p in err['loc'])}: {err['msg']} "
                       f"(got {err['input']!r})" for err in e.errors()]
        else:
            if config.sandbox != "none":
                from xrlhf.tools.sandbox import sandbox_errors

                errors += sandbox_errors(cls, config, f"{at}.options.sandbox")
            if step_timeout_s is not None and config.timeout_s >= step_timeout_s:
                errors.append(f"{at}.options.timeout_s: {config.timeout_s:g} s is not below the turn's limit "
                              f"(env.options.step_timeout_s: {step_timeout_s:g} s), which abandons the turn first; "
                              f"lower timeout_s or raise step_timeout_s")
        if cls.name in seen:
            errors.append(f"{at}.name: tool {cls.name!r} is already {where}[{seen[cls.name]}]; list each tool once")
        seen.setdefault(cls.name, i)
    return errors
