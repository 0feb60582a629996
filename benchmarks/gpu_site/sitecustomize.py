"""Stack dumps on demand for every Python process of a GPU diagnosis run.

``benchmarks/gpu_session.sh diag`` puts this directory on ``PYTHONPATH`` with
``XRLHF_STACKS_DIR`` set; every Python process started under it (the driver, Ray's workers,
vLLM's engine process) then writes all its threads' stacks to
``$XRLHF_STACKS_DIR/stacks_<pid>.txt`` when it receives SIGUSR2, and goes on running.

Signals, not a timer: ``faulthandler.dump_traceback_later`` runs a watchdog *thread*, and
re-arming it in a forked child waits for that thread, which does not exist in the child: every
``fork()`` (``subprocess.Popen(preexec_fn=...)``, multiprocessing's fork) then deadlocks. That is
what stalled the hang probes of the first GPU session (benchmarks/results/notes.md).
"""

import faulthandler
import os
import signal

_DIR = os.environ.get("XRLHF_STACKS_DIR")
_files = []


def _register() -> None:
    if not _DIR or not os.path.isdir(_DIR):
        return
    f = open(os.path.join(_DIR, f"stacks_{os.getpid()}.txt"), "a")
    _files.append(f)
    faulthandler.register(signal.SIGUSR2, file=f, all_threads=True, chain=False)


_register()
os.register_at_fork(after_in_child=_register)
