"""Puts the ``python`` tool's sandbox into Linux namespaces, then starts the runner inside.

Run as root by ``xrlhf/tools/python.py`` (``python -I -S _sandbox_ns.py CONFIG``), standalone and
single-threaded (so no ``preexec_fn`` runs in a threaded trainer). It:

1. ``unshare``\\ s mount, network, PID, IPC and UTS namespaces, and forks: the child is PID 1 of
   the new PID namespace, so when it exits the kernel kills every process the program started;
2. in the child, builds a new root on a tmpfs with read-only binds of ``/usr``, ``/lib*``,
   ``/bin``, ``/sbin`` and the interpreter's prefix, four ``/dev`` nodes, a ``/proc`` of the new
   PID namespace and a size-limited tmpfs as the work dir (the only writable place), remounts
   that root read-only, and chroots;
3. drops to a fresh unprivileged uid (so ``RLIMIT_NPROC`` counts only the sandbox's processes),
   sets no-new-privs and a parent-death SIGKILL, and execs the runner (``_sandbox_run.py``);
4. in the parent (outside the new PID namespace), waits and exits with the child's status.

The network namespace has only a loopback device, down: no address, local or remote, is
reachable. A setup failure exits 125 with ``sandbox setup failed: ...`` on stderr.
"""

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
DEVICES = ("null", "zero", "random", "urandom")
SETUP_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    """``mount(2)``; raises ``OSError`` naming the target."""
    enc = (lambda s: None if s is None else os.fsencode(s))
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def bind_read_only(path, root):
    """Make host ``path`` visible read-only at the same place under ``root`` (a symlink stays one)."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems
        os.symlink(os.readlink(path), target)
        return
    os.makedirs(target, exist_ok=True)
    mount(path, target, None, MS_BIND)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(cfg):
    """The new root at ``cfg["root"]``: read-only binds, /dev nodes and the writable work dir."""
    root, work, uid = cfg["root"], cfg["work"], cfg["uid"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in cfg["binds"]:
        bind_read_only(path, root)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's processes
    os.makedirs(root + work, exist_ok=True)
    mount("tmpfs", root + work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=700,uid={uid},gid={uid}")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")


def enter(cfg):
    """In the new namespaces (PID 1): build the root, chroot, drop privileges, exec the runner."""
    build_root(cfg)
    os.chroot(cfg["root"])
    os.chdir(cfg["work"])
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")  # after setuid, which clears it
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])


def fail(error):
    sys.stderr.write(f"sandbox setup failed: {error}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def main():
    cfg = json.loads(sys.argv[1])
    try:
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    except OSError as e:
        fail(e)
    pid = os.fork()
    if pid == 0:
        try:
            enter(cfg)
        except BaseException as e:  # noqa: BLE001 - any failure before exec is a setup failure
            fail(e)
    status = os.waitpid(pid, 0)[1]
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        sys.stderr.write(f"\nerror: killed by {signal.Signals(-code).name}\n")
        sys.exit(128 - code)
    sys.exit(code)


if __name__ == "__main__":
    main()
