"""``Coordinator``: starts Ray, places the handles, builds their engines, wires weight sync.

It builds what the shell's ``Topology`` (``coordinator/spec.py``) says and reads no config. The
algorithm layer gets ready ``ModelHandle`` objects (``policy``, ``generator``, ``critic``,
``reference``, ``reward``, ``teacher``: ``engines.handles.Handles``, which it implements) and calls
``sync_weights(version)`` after each policy update.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Iterator

import ray
from loguru import logger

from xrlhf.config.schema import RayConfig
from xrlhf.coordinator.handle import ROLLOUT_GROUPS, ModelHandle
from xrlhf.coordinator.health import HEALTH_GROUP, Heartbeat
from xrlhf.coordinator.forkserver import NOTHING, SERVER, base_worker_env, environ, fork_plan, fork_server_works
from xrlhf.coordinator.forkserver import preloads as _preloads
from xrlhf.coordinator.mps import sm_limit_warning
from xrlhf.coordinator.resources import Slot, place
from xrlhf.coordinator.spec import HandleSpec, Topology
from xrlhf.coordinator.weight_routes import WeightRoutes
from xrlhf.coordinator.worker import EngineWorker
from xrlhf.engines.base import DistInfo, EngineSpec, engine_class
from xrlhf.engines.handles import Handles
from xrlhf.internals.process import Watchdog, descendants_now, kill_started_since
from xrlhf.internals.ray import init_options, lean_head
from xrlhf.utils import bytecode
from xrlhf.utils.errors import WorkerDiedError
from xrlhf.utils.faults import Healing
from xrlhf.utils.run_hooks import RunHooks


WATCHDOG = Watchdog()
"""A local Ray's watchdog (``internals/watchdog.py``): when this process dies, however it dies,
the processes started since Ray's start die within about a second and a half."""


def init_ray(options: RayConfig, preload: dict[str, list] | None = None) -> bool:
    """Start a local Ray, or join ``ray.address``; workers see the driver's import path. A local
    Ray's processes die with this one, however it dies (``WATCHDOG``). ``preload``: the handles'
    ``forkserver.fork_plan``; where engines import long (vLLM), a local Ray's fork server imports
    what every handle needs while Ray starts (``coordinator.forkserver``, ``ray.fork_server``;
    ``shutdown_ray`` stops it).

    Returns whether this call started (and so owns) the Ray connection; an already
    initialised Ray (a notebook's, a test session's) is used as it is.
    """
    if ray.is_initialized():
        return False
    env = _worker_env()
    # Ray's notice that token authentication is on (it stays on) is not the user's business here.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    kwargs: dict[str, Any] = {"log_to_driver": options.log_to_driver, "logging_level": "WARNING",
                              "configure_logging": True}
    if options.address:  # a cluster's workers get the variables through the job's runtime environment
        ray.init(address=options.address, runtime_env={"env_vars": env}, **kwargs)
        return True
    # "local": a Ray of this run's own, even where a cluster started by `ray start` runs on this
    # machine (ray.init would join it, and refuse num_cpus); joining one is ray.address. Its
    # processes inherit this one's environment, so the variables are set here for the start: a
    # runtime environment would make every worker wait for Ray's runtime-env agent (docs/architecture.md).
    if (warning := sm_limit_warning()) is not None:
        logger.warning(warning)
    if stale := bytecode.uncompiled():  # the workers are processes of this environment
        logger.warning(bytecode.warning(stale))
    with environ(env):
        if preload and _forks(options) and not SERVER.running and not SERVER.failed():
            SERVER.start(preload)  # before Ray (its imports overlap Ray's start), in Ray's workers' environment
        WATCHDOG.start()  # before Ray: it notes the processes started after it
        # Ray starts its workers at nice 15, below everything else on the machine. Ours are the
        # run: beside any other busy process they starved (docs/testing.md).
        with lean_head():
            _start_head(num_cpus=options.num_cpus or os.cpu_count(), num_gpus=options.num_gpus,
                        include_dashboard=False, **init_options(), **kwargs)
    return True


HEAD_ATTEMPTS = 2
"""How many times a local Ray's head is started before its failure is the run's."""


def _start_head(**init_kwargs: Any) -> None:
    """``ray.init(address="local", **init_kwargs)``, once more where the head fails to start: on a
    loaded 2-core box Ray's GCS server once died as it started (glibc: "malloc(): unaligned fastbin
    chunk detected"; Ray 2.60) and ray.init timed out waiting for its port. What the failed start
    left (a GCS still starting, a raylet) is killed before the next one."""
    for attempt in range(1, HEAD_ATTEMPTS + 1):
        before = descendants_now()
        try:
            ray.init(address="local", **init_kwargs)
            return
        except (RuntimeError, ConnectionError, TimeoutError, OSError) as exc:
            if attempt == HEAD_ATTEMPTS:
                raise
            ray.shutdown()
            left = kill_started_since(before)
            first = (str(exc).strip().splitlines() or [""])[0]
            logger.warning(f"Ray's local head did not start ({type(exc).__name__}: {first}); "
                           f"stopped what it left ({left} process{'es' if left != 1 else ''}), starting it once more")


def _worker_env() -> dict[str, str]:
    """What a local Ray's workers (and the fork server) get in their environment beside the driver's."""
    return base_worker_env()


def _forks(options: RayConfig) -> bool:
    """Whether a local Ray with ``options`` forks its preloading workers (``ray.fork_server``)."""
    return bool(getattr(options, "fork_server", False)) and not options.address and fork_server_works()


def shutdown_ray() -> None:
    """Stop Ray, then the fork server and the watchdog started with it (if any)."""
    ray.shutdown()
    SERVER.stop()
    WATCHDOG.stop()


WORKER_POINTS = ("born_s", "module_s", "imported_s", "init_s", "called_s")
"""When rank 0's process started, began and ended importing the worker's class, was constructed,
began its engines' imports (``preload``: in the constructor where they take long, vLLM's, else
the first call); s after Ray's start, ``EngineWorker.setup``'s ``timeline``."""


def _startup_line(times: dict[str, float]) -> str:
    """``Coordinator.startup`` as one line: Ray, then per handle when its rank 0's process was
    born, had imported its class, was constructed and began its preload, its workers up, what
    rank 0's imports and engines took, and when its engines were built."""
    parts = [f"Ray {times['ray_s']:.1f}"]
    for name in dict.fromkeys(k.split("/")[0] for k in times if "/" in k and not k.startswith("fork_server/")):
        own = {k.split("/", 1)[1]: v for k, v in times.items() if k.startswith(name + "/")}
        points = "".join(f"{k.removesuffix('_s')} {own[k]:.1f}, " for k in WORKER_POINTS if k in own)
        inner = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in own.items()
                          if k not in ("up_s", "built_s", *WORKER_POINTS))
        parts.append(f"{name}: {points}up {own.get('up_s', 0):.1f}" + (f" ({inner})" if inner else "")
                     + f", built {own.get('built_s', 0):.1f}")
    if "fork_server/started_s" in times:  # before Ray's start (negative) where the CLI started it
        parts.append(f"fork server: started {times['fork_server/started_s']:.1f}"
                     + (f", plain copy {times['fork_server/plain_s']:.1f}" if "fork_server/plain_s" in times else "")
                     + (f", imported {times['fork_server/imported_s']:.1f}" if "fork_server/imported_s" in times else ""))
    return "; ".join(parts) + f"; ready {times['ready_s']:.1f}"


def _alone(engines: dict[str, tuple[str, EngineSpec]]) -> dict[str, tuple[str, EngineSpec]]:
    """The engines of ``engines`` (role -> (name, spec)) that start alone (``Engine.starts_alone_with``)."""
    return {role: e for role, e in engines.items() if engine_class(e[0], role).starts_alone_with(e[1].options)}


class Coordinator(Handles):
    """Owns Ray and the handles of one run.

    Args:
        topology: what to build (``xrlhf.topology.topology``: handles, placement, weight sync).
        healing: restarts left and made, shared with the runner's restarts from a checkpoint.
        keep_ray: ``shutdown`` leaves a Ray this coordinator started running (the runner stops
            it at the end: a restart from a checkpoint reuses it).
        hooks: the run's (``RunHooks``): ``workers`` after a handle was restarted in place,
            ``running_step`` for the healing record.
    """

    def __init__(self, topology: Topology, healing: Healing | None = None, keep_ray: bool = False,
                 hooks: RunHooks | None = None):
        self.topology = topology
        self.specs = topology.handles
        self.healing = healing or Healing(topology.fault_tolerance.max_restarts)
        self.keep_ray = keep_ray
        self.reference_from_policy = topology.reference_from_policy
        """The reference is the policy's base with its LoRA adapters off (no handle of its own)."""
        self.handles: dict[str, ModelHandle] = {}
        self.placement_groups: list = []
        self.pids: dict[str, list[int]] = {}
        """Each handle's worker process ids, in rank order (the runner writes them to workers.json)."""
        self.hooks = hooks or RunHooks()
        self.version: int | None = None
        """The policy version the generators hold (the last ``sync_weights``'s)."""
        self.slots: dict[str, Slot] = {}
        self.weight_sync: WeightRoutes | None = None
        self.transport: str | None = None
        self.startup: dict[str, float] = {}
        """Seconds from Ray's start: ``ray_s``, per handle ``<name>/up_s`` (its first worker up),
        ``<name>/built_s`` (its engines built), what rank 0 timed (``EngineHost.setup``) and when its
        process was born, had imported its class, was constructed and began its first call
        (``WORKER_POINTS``), ``ready_s``."""
        self._owns_ray = False
        self._heal_lock = threading.Lock()

    def start(self) -> "Coordinator":
        t0 = time.time()
        logger.info("starting Ray and the workers (" + ", ".join(f"{s.name} x{s.resources.ranks}" for s in self.specs)
                    + "); this takes 20-40 s on a laptop CPU")
        plan = fork_plan(self.specs)
        self._owns_ray = init_ray(self.topology.ray, preload=plan)
        if SERVER.running:
            long = ", ".join(sorted({n for n, _, _ in plan["long"]}))
            logger.info(f"fork server (pid {SERVER.proc.pid}): imports what {long} needs beside Ray's start, and "
                        "before it what the other handles' engines need (a copy of its own holds those); the workers "
                        "are forked from them")
        times: dict[str, Any] = {"ray_s": time.time() - t0}
        slots = self.slots = place({s.name: s.resources for s in self.specs})
        self.placement_groups = list({id(s.pg): s.pg for s in slots.values()}.values())
        # Every handle's workers are created before any is waited for, those that preload (vLLM's
        # import, the longest path to ready) first, so their processes start and import side by side.
        # Every handle's engines then build at once, except the engines that size themselves from
        # the GPU memory they see free (``starts_alone``: vLLM's KV cache): those start after all the
        # others, while no other worker allocates or frees GPU memory.
        first = sorted(self.specs, key=lambda s: not _preloads(s.engines))
        handles = {s.name: self._spawn(s, slots[s.name]) for s in first}
        steps: list[tuple[ModelHandle, list, dict, list[DistInfo]]] = []
        # each handle builds as soon as its first worker is up: in a fixed order, one forked late
        # held back the others' builds and one forked early waited for the others' (docs/architecture.md)
        for s in self._as_they_come_up(handles):
            handle = self.handles[s.name] = handles[s.name]
            alone = _alone(s.engines)
            refs, dists = self._setup(s, handle, engines={r: e for r, e in s.engines.items() if r not in alone})
            times[f"{s.name}/up_s"] = time.time() - t0
            steps.append((handle, refs, alone, dists))
        for handle, refs, _, _ in steps:
            self._finish(handle, refs, {}, [], times, t0)
        for handle, _, alone, dists in steps:
            if alone:
                self._finish(handle, [], alone, dists, times, t0)
        self._wire_weight_sync()
        if SERVER.started_at is not None:
            times.update(self._fork_server_times(t0))
        ft = self.topology.fault_tolerance
        monitor = Heartbeat(lambda: self.handles, ft.heartbeat_timeout_s) if ft.heartbeat_timeout_s > 0 else None
        for h in self.handles.values():
            h.monitor, h.healer = monitor, self
        times["ready_s"] = time.time() - t0
        self.startup = {k: round(v, 2) for k, v in times.items()}
        logger.info(f"Ray handles ready in {times['ready_s']:.1f}s: " + ", ".join(
            f"{h.name} x{h.world_size}" for h in self.handles.values()))
        logger.info("start-up (s from the start of Ray): " + _startup_line(self.startup))
        if self.reference_from_policy:
            logger.info("reference: the policy's base with its LoRA adapters off (computed by the policy's workers; "
                        "no model of its own)")
        return self

    def _as_they_come_up(self, handles: dict[str, ModelHandle]) -> Iterator[HandleSpec]:
        """The specs in the order their handle's first worker answers (its process up, its class
        imported); one whose worker failed to start comes in its turn (``_setup`` reports it)."""
        refs = {handles[s.name].workers[0].ping.remote(): s for s in self.specs}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            if ready:
                yield refs[ready[0]]

    @staticmethod
    def _fork_server_times(t0: float) -> dict[str, float]:
        """When the fork server's imports ended (s after ``t0``); warns where it could not fork."""
        status = SERVER.status()
        if status and not status.get("usable") and status.get("why") != NOTHING:
            logger.warning(f"fork server: {str(status.get('why')).splitlines()[0]}; its workers started the usual "
                           "way (ray.fork_server: false skips it)")
        out = {"fork_server/started_s": SERVER.started_at - t0}
        if status.get("plain_pid"):  # when its plain copy was ready
            out["fork_server/plain_s"] = status["plain_at"] - t0
        if status.get("imported_at"):
            out["fork_server/imported_s"] = status["imported_at"] - t0
        return out

    def _spawn(self, s: HandleSpec, slot: Slot) -> ModelHandle:
        """New workers of handle ``s`` in ``slot`` (not waited for); each starts importing what its
        engines need (``EngineHost.preload``) in its constructor, as soon as its process is up."""
        # a generator runs generate calls beside each other (the parts of a batch, an evaluation,
        # episode turns) and beside a weight sync (in-flight updates)
        concurrent = "generate" in s.engines
        groups = {HEALTH_GROUP: 1}  # heartbeats are answered beside any call (``health.Heartbeat``)
        if concurrent:
            groups["rollout"] = max(ROLLOUT_GROUPS["rollout"], self.topology.concurrent_generate)
        actor = ray.remote(concurrency_groups=groups)(EngineWorker)
        preload = s.engines if _preloads(s.engines) else None  # imports that take long (vLLM): at once
        # and from the fork server, where one runs (any other handle from its plain copy): the
        # process begins with them imported
        forked = {"runtime_env": env} if (env := SERVER.runtime_env(long=preload is not None)) else {}
        workers = [actor.options(**slot.options(rank), **forked, max_restarts=0,
                                 name=None).remote(s.name, rank, slot.threads, preload)
                   for rank in range(s.resources.ranks)]
        return ModelHandle(s.name, workers, trainable="train" in s.engines, concurrent=concurrent)

    def _setup(self, s: HandleSpec, handle: ModelHandle, timeout: float | None = None,
               engines: dict | None = None) -> tuple[list, list[DistInfo]]:
        """Wait for ``handle``'s first worker to be up, then start building ``engines`` (default:
        all of the handle's; none: no call) on every worker. Returns the ``setup`` calls under way
        and each rank's ``DistInfo`` (for a later ``_finish``)."""
        master, port = handle._get([handle.workers[0].address.remote()], [0], timeout)[0]
        backend = "nccl" if s.resources.gpus_per_rank > 0 else "gloo"
        dists = [DistInfo(rank, handle.world_size, master, port, backend,
                          self.topology.fault_tolerance.collective_timeout_s) for rank in range(handle.world_size)]
        engines = s.engines if engines is None else engines
        refs = [w.setup.remote(engines, d) for w, d in zip(handle.workers, dists)] if engines else []
        return refs, dists

    def _create(self, s: HandleSpec, slot: Slot, timeout: float | None = None) -> tuple[ModelHandle, list]:
        """New workers of handle ``s`` in ``slot`` building all its engines: the handle and the
        ``setup`` calls under way (a restart in place)."""
        handle = self._spawn(s, slot)
        refs, _ = self._setup(s, handle, timeout)
        return handle, refs

    def _finish(self, handle: ModelHandle, refs: list, engines: dict, dists: list[DistInfo],
                times: dict[str, Any], t0: float) -> None:
        """Wait for ``handle``'s ``setup`` calls ``refs``, then build ``engines`` on every worker
        (with ``dists``) and wait; records the workers' pids, and in ``times`` when the handle's
        engines were built (s after ``t0``) and what rank 0 says its build took."""
        ranks = list(range(handle.world_size))

        def wait(calls: list) -> None:
            results = handle._get(calls, ranks)
            self.pids[handle.name] = [r["pid"] for r in results]
            # when its last rank finished (the handles are waited for one after another: the time
            # of the wait would credit a fast handle with a slow one's build)
            times[f"{handle.name}/built_s"] = max(r.get("done_at", time.time()) for r in results) - t0
            times.update({f"{handle.name}/{k}": v for k, v in results[0].get("seconds", {}).items()})
            for k, at in results[0].get("timeline", {}).items():  # rank 0's process: born, imported ...
                if at is not None:
                    times.setdefault(f"{handle.name}/{k.removesuffix('_at')}_s", at - t0)

        if refs:
            wait(refs)
        if engines:
            wait([w.setup.remote(engines, d) for w, d in zip(handle.workers, dists)])

    def _wire_weight_sync(self) -> None:
        plan = self.topology.weight_sync
        if plan is None or "rollout" not in self.handles:  # nothing generates (a reward model being trained)
            return
        gen = self._spec("rollout").engines["generate"]
        self.weight_sync = WeightRoutes(plan, self.handles["policy"], self.handles["rollout"],
                                        (gen[0], gen[1].options))
        self.transport = self.weight_sync.setup()
        logger.info(f"weight sync: {self.transport} ({'co-located' if plan.colocated else 'split'} layout, "
                    f"verify {'on' if plan.verify else 'off'})")

    # -- ``Handles``: the handles by role are its own (policy, generator, ...) -----------------
    def end_rollout(self) -> None:
        """Generation is over until the next sync: co-located generators free their memory."""
        if self.weight_sync is not None:
            self.weight_sync.end_rollout()

    def sync_weights(self, version: int | None = None) -> float:
        """Push the policy's new weights (policy ``version``) to the generate engines; returns
        seconds taken."""
        self.version = version
        return self.weight_sync.sync(version) if self.weight_sync is not None else 0.0

    # -- healing ------------------------------------------------------------------------------
    def _spec(self, name: str) -> HandleSpec | None:
        return self.topology.spec(name)

    def in_place(self, name: str) -> bool:
        """Whether handle ``name`` is restarted on its own when a worker dies: one without training
        state (the reference, the reward model, the teacher, the generators of a synchronous
        rollout: what they hold is on disk or is the trainer's current weights), unless a broadcast
        sync to the generators is under way."""
        spec = self._spec(name)
        if spec is None or "train" in spec.engines:
            return False
        if not self._receives_weights(name):
            return True  # its model is on disk (a teacher's generate engine gets no weights either)
        # an asynchronous rollout's generators may hold an older version than the trainer's; a
        # broadcast sync is a collective with the policy's rank 0, which may be blocked in it while
        # one runs (between syncs the group is opened anew with the new generators: setup())
        blocked = self.weight_sync is not None and self.weight_sync.kind == "broadcast" and self.weight_sync.syncing
        return self.topology.max_staleness == 0 and not blocked

    def _receives_weights(self, name: str) -> bool:
        """Whether handle ``name`` holds the policy's synced weights (the generators, ``rollout``)."""
        return name == "rollout" and self.weight_sync is not None

    def heal(self, error: WorkerDiedError) -> bool:
        """Restart the dead worker's handle in place (new workers in the same placement-group
        bundles, the same engines; generators get the trainer's current weights, verified); True
        when done (or done already by another thread), False when the run must restart from a
        checkpoint: a handle with training state, or no restart left."""
        name = error.handle
        if name is None or not self.in_place(name) or name not in self.handles:
            return False
        with self._heal_lock:
            old = self.handles[name]
            if error.worker is not None and all(w != error.worker for w in old.workers):
                return True  # another thread healed it meanwhile
            if self.healing.left <= 0:
                return False
            t0 = time.time()
            logger.warning(f"{error}; restarting {name} ({old.world_size} worker(s)) in place "
                           f"({len(self.healing.events) + 1}/{self.healing.max_restarts})")
            old.kill()
            spec = self._spec(name)
            # a worker that cannot be placed again (its node is gone) fails here, not in a hang
            new, setup = self._create(spec, self.slots[name], timeout=300)
            self.pids[name] = [r["pid"] for r in new._get(setup, list(range(new.world_size)), timeout=600)]
            old.workers = new.workers  # the trainer's handle objects stay valid
            synced = ""
            if self._receives_weights(name):
                self.weight_sync.setup()
                self.weight_sync.sync(self.version)
                synced = f", weights of policy version {self.version or 0} re-synced" + \
                    (" (verified)" if self.weight_sync.plan.verify else "")
            event = self.healing.record(error, "in place", time.time() - t0, "the interrupted call",
                                        self.hooks.running_step())
            logger.warning(f"{name} restarted in {event['recover_s']:.1f} s{synced}; redoing the interrupted call")
            self.hooks.workers(self.pids)
            return True

    def memory(self) -> dict[str, list[dict[str, float]]]:
        """Every handle's ranks' memory (``EngineHost.memory_stats``; their GPU peaks reset)."""
        pending = {name: h.memory_stats(wait=False) for name, h in self.handles.items()}
        return {name: p.get() for name, p in pending.items()}

    def __getitem__(self, name: str) -> ModelHandle:
        return self.handles[name]

    def get(self, name: str) -> ModelHandle | None:
        return self.handles.get(name)

    def shutdown(self, wait_s: float = 10.0) -> None:
        """Kill the workers, free their placement groups, stop Ray if this run started it; each
        worker first frees what it holds, waited for ``wait_s`` seconds at most (a run aborted by
        a second signal waits 1)."""
        from ray.util.placement_group import remove_placement_group

        closing = [w.shutdown.remote() for h in self.handles.values() for w in h.workers]
        try:  # engines and transports free what outlives a killed process (shared memory, vLLM)
            ray.wait(closing, num_returns=len(closing), timeout=wait_s)
        except Exception:  # noqa: BLE001 - best effort on the way out: dead workers are killed below
            pass
        for h in self.handles.values():
            try:
                h.kill()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self.handles.clear()
        self.placement_groups = []
        if self._owns_ray and not self.keep_ray and ray.is_initialized():
            shutdown_ray()
