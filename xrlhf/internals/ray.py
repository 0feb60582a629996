"""Ray's internals: a lean head for a local Ray, and its workers at the driver's priority."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from xrlhf.internals import Hook, needs

_HEAD_PARTS = ("start_api_server", "start_monitor")


LEAN_HEAD = Hook(
    "ray.lean_head", "ray", ("2.60", "2.60"),
    buys="a local Ray's head starts without the dashboard's API server and the autoscaler's monitor, "
         "which a run never uses (ray.init waits ~2 s for the API server)",
    without="a local Ray starts its whole head",
    probe=needs("ray._private.node", *(f"Node.{n}" for n in _HEAD_PARTS)))


@contextmanager
def lean_head() -> Iterator[None]:
    """Within the block, a local Ray's head starts without its API server and monitor (the
    private ``Node`` methods that start them do nothing); outside it they are Ray's again."""
    if not LEAN_HEAD.active():
        yield
        return
    import ray._private.node as node

    saved = {n: node.Node.__dict__[n] for n in _HEAD_PARTS}
    for n in _HEAD_PARTS:
        setattr(node.Node, n, lambda self, **_: None)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(node.Node, n, f)


NICENESS = Hook(
    "ray.worker_niceness", "ray", ("2.60", "2.60"),
    buys="a local Ray's workers run at the driver's priority, not nice 15: beside any other busy process "
         "they are the run, not the machine's last priority",
    without="Ray starts its workers at nice 15",
    probe=needs("ray._private.ray_constants", "RAY_WORKER_NICENESS"))


def init_options() -> dict[str, Any]:
    """Extra ``ray.init`` arguments for a local Ray (``_system_config``, which Ray calls testing-only)."""
    return {"_system_config": {"worker_niceness": 0}} if NICENESS.active() else {}
