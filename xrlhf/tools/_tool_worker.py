"""Serves one tool's calls inside its sandbox; ``xrlhf/tools/sandbox.py`` starts it.

Started as ``python -S -s -B -u -c BOOT CONFIG`` in a scrubbed environment (possibly inside the
namespace sandbox's chroot, where only the system dirs, the interpreter and the import path are
visible, read-only). In order it:

1. keeps its stdout as the reply channel and points fd 1 at stderr, so what the tool prints goes
   to the worker's log, never into a reply;
2. sets the resource limits (``_sandbox_run.set_limits``);
3. imports the tool's class by its import path and validates its options;
4. installs the audit hook (``_sandbox_run.make_hook``: no writes outside the work dir, no
   sockets, no processes), then builds the tool, so its constructor runs under the hook too;
5. answers ``{"ready": true}`` (or ``{"ready": false, "error": ...}``), then one JSON line per
   request line: ``{"arguments": ...}`` -> ``{"output": str, "error": bool}``, until stdin ends.

A thread watches stdin for a hang-up: when the trainer is gone (its end of the pipe closed, by a
crash or a kill), the worker exits at once, even in the middle of a call that never returns.
"""

import json
import os
import sys

BOOT = ("import json, os, sys\ncfg = json.loads(sys.argv[1])\nsys.path[:0] = cfg['path']\n"
        "try:\n"
        "    from xrlhf.tools._tool_worker import main\n"
        "except ImportError as e:\n"
        "    dirs = cfg['path'] + [os.path.join(p, 'xrlhf') for p in cfg['path']]\n"
        "    bad = [p for p in dirs if os.path.isdir(p) and not os.access(p, os.R_OK | os.X_OK)]\n"
        "    hint = ' (the sandbox user cannot read ' + ', '.join(bad) + ': make it readable by other users, chmod "
        "o+rX, or set the tool sandbox: process)' if bad else ''\n"
        "    print(json.dumps({'ready': False, 'error': type(e).__name__ + ': ' + str(e) + hint}), flush=True)\n"
        "    sys.exit(1)\n"
        "sys.exit(main(cfg))\n")
"""The ``-c`` program: the import path first (``-S`` left site-packages out), then :func:`main`.
xrlhf itself may be what the sandbox's user cannot import (its directory unreadable to that
user): the start then fails with the same one-line report as any tool's import error."""


def send(channel, message):
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def load(path):
    """The attribute ``pkg.mod:Attr`` names."""
    import importlib

    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def build(cfg):
    """The tool, built under the audit hook; raises whatever import or construction raises."""
    from xrlhf.tools._sandbox_run import make_hook

    cls = load(cfg["tool"])
    config = cls.Config.model_validate(cfg["options"])
    if cfg["audit_hook"]:
        sys.addaudithook(make_hook(os.path.realpath(cfg["work"])))
    return cls(config)


def unreadable(paths, module=""):
    """Dirs this process cannot read (the namespace sandbox's fresh uid): entries of the import
    path, and the package directories of ``module`` (``pkg.sub``) under them (a package of mode
    0700 inside a readable directory)."""
    parts = [p for p in module.split(".") if p]
    dirs = list(paths)
    for root in paths:
        for depth in range(1, len(parts) + 1):
            dirs.append(os.path.join(root, *parts[:depth]))
    return [p for p in dirs if os.path.isdir(p) and not os.access(p, os.R_OK | os.X_OK)]


def exit_when_orphaned(fd=0):
    """Exit the process once nobody can write to ``fd`` (the trainer closed its end or died)."""
    import select
    import threading

    def watch():
        poll = select.poll()
        poll.register(fd, 0)  # POLLHUP and POLLERR are always reported; data is the main loop's
        while True:
            for _, events in poll.poll():
                if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os._exit(0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def main(cfg):
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    exit_when_orphaned()
    from xrlhf.tools._sandbox_run import set_limits

    set_limits(cfg["limits"])
    try:
        tool = build(cfg)
    except BaseException as e:  # noqa: BLE001 - any failure to start is reported, in one line
        from xrlhf.tools.base import one_line

        error = f"{type(e).__name__}: {one_line(e)}"
        blocked = unreadable(cfg["path"], cfg["tool"].partition(":")[0])
        if blocked and isinstance(e, ImportError):
            error += (f" (the sandbox's user cannot read {', '.join(blocked)}: make it readable by other users, "
                      f"chmod o+rX, or set the tool's sandbox: process)")
        send(channel, {"ready": False, "error": error})
        return 1
    send(channel, {"ready": True})
    from xrlhf.tools.base import run_tool, truncate

    for line in sys.stdin:
        result = run_tool(tool, json.loads(line)["arguments"])
        send(channel, {"output": truncate(str(result.output), tool.config.max_output_chars),
                       "error": bool(result.error)})
    return 0
