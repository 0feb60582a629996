"""Runs one program inside the ``python`` tool's sandbox; ``xrlhf/tools/python.py`` starts it.

Standalone on purpose: it is passed to ``python -S -s -B -u -c`` in a scrubbed environment,
possibly inside a chroot that holds nothing but the interpreter, so it imports only the standard
library and never xrlhf. In order it:

1. reads the program from stdin, then points stdin at ``/dev/null``;
2. sets the resource limits (hard = soft, so the program cannot raise them);
3. installs the audit hook (the second layer, ``audit_hook`` option): it refuses process
   creation, signals, sockets, writes outside the work dir, ctypes and raising limits;
4. runs the program as ``__main__``; an uncaught exception prints a traceback of the program's
   own frames and exits 1.

The audit hook is a tripwire that catches ordinary programs doing what they should not; it is
**not** a security boundary (CPython's audit hooks can be bypassed by a determined program). The
boundary is the kernel's: namespaces, chroot, a fresh uid and rlimits (see docs/tools.md).
"""

import json
import os
import sys
from types import MappingProxyType

DENIED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system", "subprocess.Popen",
    "os.kill", "os.killpg", "signal.pthread_kill",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname",
    "resource.setrlimit", "resource.prlimit",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents",
})
"""Events refused outright: new processes, signals, network, limits, raw memory and the
object-graph walks that reach the hook's own state."""

DENIED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_testcapi", "_testinternalcapi",
                            "_xxsubinterpreters", "cffi"})
"""Modules that start processes or touch memory without raising an audit event of their own."""

PATH_EVENTS = MappingProxyType({
    # event: ((position of a path that must be inside the work dir, position of its dir_fd), ...)
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
    "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "os.chflags": ((0, None),),
    "os.lchflags": ((0, None),),
})
"""Events that change the file system at a path: allowed only inside the work dir. A path relative
to a ``dir_fd`` is resolved through ``/proc/self/fd`` (``shutil.rmtree`` works that way)."""

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def set_limits(cfg):
    """Soft and hard limits of this process (and everything it would start)."""
    import resource

    mb = 1 << 20
    limits = {"RLIMIT_AS": cfg["memory_mb"] * mb, "RLIMIT_CPU": cfg["cpu_s"], "RLIMIT_FSIZE": cfg["file_mb"] * mb,
              "RLIMIT_NOFILE": cfg["max_files"], "RLIMIT_NPROC": cfg["max_processes"], "RLIMIT_CORE": 0}
    for name, value in limits.items():
        if value is not None:
            resource.setrlimit(getattr(resource, name), (value, value))


def make_hook(work):
    """The audit hook that keeps a program to its work dir (see ``DENIED_*``, ``PATH_EVENTS``)."""
    realpath, fsdecode, join, isabs, readlink, sep = (os.path.realpath, os.fsdecode, os.path.join, os.path.isabs,
                                                      os.readlink, os.sep)

    def inside(path, dir_fd=None, work=work):
        if isinstance(path, int):  # an open file descriptor: its opening was checked
            return True
        path = fsdecode(path)
        if dir_fd not in (None, -1) and not isabs(path):  # -1: the event's "no dir_fd"
            try:
                path = join(readlink(f"/proc/self/fd/{dir_fd}"), path)
            except OSError:
                return False
        real = realpath(path)
        return real == work or real.startswith(work + sep)

    def hook(event, args, inside=inside, denied=DENIED_EVENTS, imports=DENIED_IMPORTS, paths=PATH_EVENTS):
        if event in denied:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].partition(".")[0] in imports:
            raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
        if event == "open" and isinstance(args[2], int) and args[2] & WRITE_FLAGS and not inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} is not allowed (only inside the work dir)")
        for where, dir_fd in paths.get(event, ()):
            if not inside(args[where], None if dir_fd is None else args[dir_fd]):
                raise PermissionError(f"sandbox: {event} of {args[where]!r} is not allowed (only inside the work dir)")

    return hook


def run_program(code):
    """Run ``code`` as a fresh ``__main__`` module; return the exit status."""
    import linecache

    main = type(sys)("__main__")
    sys.modules["__main__"] = main
    sys.argv = ["<program>"]
    linecache.cache["<program>"] = (len(code), None, code.splitlines(True), "<program>")
    try:
        exec(compile(code, "<program>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the program's error is reported, not re-raised
        sys.stdout.flush()
        sys.stderr.write(short_traceback(e))
        return 1
    return 0


def short_traceback(e):
    """The traceback of ``e`` without this runner's frames (the audit hook's included) and
    without the ``^^^`` marker lines: the program's own story, in few tokens."""
    import traceback

    tb = traceback.TracebackException(type(e), e, e.__traceback__.tb_next)
    tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if f.filename != "<string>"])
    lines = "".join(tb.format()).splitlines(True)
    return "".join(line for line in lines if line.strip(" ~^\n"))


def main():
    cfg = json.loads(sys.argv[1])
    code = sys.stdin.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    set_limits(cfg)
    if cfg["audit_hook"]:
        sys.addaudithook(make_hook(os.path.realpath(cfg["work"])))
    sys.exit(run_program(code))


if __name__ == "__main__":
    main()
