"""One run, start to finish: output directory, warm-up, Ray handles, the trainer, summary.

Outputs in the run directory: ``config.yaml`` (resolved), ``train.log``, ``metrics.jsonl``
(one JSON object per step), ``tensorboard/``, ``checkpoints/``, ``summary.json``,
``final/`` (the policy in HF format), ``report.md`` and ``plots/``, and ``run.lock``: one run at
a time writes there (``xrlhf.rundir``).

Runs survive: checkpoints every ``checkpoint.every`` steps or ``checkpoint.every_minutes`` (10 by
default), whichever comes first, the supervised warm-up's too; ``--resume`` continues from the
latest one bit for bit, or to more ``trainer.steps``; SIGINT/SIGTERM finish the step (user code
and the rollout get ``STOP_GRACE_S``), checkpoint and exit, a second one exits at once; a dead
worker stops the run naming it, or restarts from the last checkpoint (``fault_tolerance``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from loguru import logger

from xrlhf.checkpoint import (WARMUP, SaveSchedule, any_checkpoint, checkpoint_dir, checkpoint_step, list_checkpoints,
                              load_driver_state, read_driver_state, remove_checkpoints, restore_handles,
                              resume_checkpoint, save_checkpoint)
from xrlhf.config import XConfig, dump_config
from xrlhf.utils.faults import Healing
from xrlhf.data.text import load_tokenizer
from xrlhf.envs import build_env
from xrlhf.rundir import AGAIN, NEW, SUMMARY, RunLock, begin_attempt, check_output_dir, make_output_dir
from xrlhf.tracking import Tracker
from xrlhf.utils.bounded import STOPPING, UserCodeAborted
from xrlhf.utils.errors import UserError, WorkerDiedError
from xrlhf.utils.files import atomic_write
from xrlhf.utils.run_hooks import RunHooks
from xrlhf.resolved import resolved_config
from xrlhf.validation import algorithm_options


STOP_GRACE_S = 3.0
"""How long a first signal lets user code (a tool, an env's step) and the rollout (the batch the
step or its checkpoint needs) run on before the run gives up on them (``utils.bounded.STOPPING``)."""
ABORT_S = 1.0
"""How long a second signal lets the run save the last step done before it aborts."""


class Interrupted(Exception):
    """The run stopped on a signal; ``code`` is the exit status.

    ``saved``: whether a checkpoint is there to resume from (a signal before the first RL step
    and before the warm-up's first checkpoint leaves nothing to resume). ``urgent``: a second
    signal came (the program ends at once: ``internals.process.quick_exit``).
    """

    def __init__(self, signum: int, out: Path, saved: bool = True, urgent: bool = False):
        self.code = 130 if signum == signal.SIGINT else 0
        self.out, self.saved, self.urgent = out, saved, urgent
        where = "" if saved else " before the first RL step; nothing was saved"
        super().__init__(f"stopped by signal {signal.Signals(signum).name}{where}")


class StopRequest:
    """SIGINT/SIGTERM end the run after the current step; a second one ends it within ``ABORT_S``.

    The first sets a flag the runner reads between steps, and ``utils.bounded.STOPPING``
    ``STOP_GRACE_S`` later: what still waits then for user code or for the rollout gives up
    (the runner then saves the last step done). The second sets ``STOPPING`` at once and, unless
    the run has saved and is ending by then (``interrupted``), raises ``KeyboardInterrupt``
    ``ABORT_S`` later (a third signal: at once); a checkpoint being written then (``saving``)
    is finished first, unless one more signal comes.
    """

    def __init__(self):
        self.signum: int | None = None
        self.urgent = False
        """A second signal came: no more waiting anywhere (no report, workers not waited for)."""
        self.aborted = False
        self.doing = "the current step, then checkpoint and exit"
        """What a first signal waits for (the runner updates it: warm-up, Ray start-up, RL steps)."""
        self._previous: dict[int, Any] = {}
        self._saving = 0
        self._abort_after_save = False
        self._fuse: threading.Timer | None = None

    def __enter__(self) -> "StopRequest":
        STOPPING.clear()  # left set by a stopped run before (in this process): the process was ending
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def install(self) -> None:
        """Take the signals back (``ray.init`` installs its own SIGTERM handler, which aborts)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        self._defuse()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __bool__(self) -> bool:
        return self.signum is not None

    def interrupted(self, out: Path) -> "Interrupted":
        """The run's end by the signal, once it saved what it could: a second signal's abort is
        called off (what is left is the clean-up)."""
        self._defuse()
        return Interrupted(self.signum, out, saved=any_checkpoint(out) is not None, urgent=self.urgent)

    @contextmanager
    def saving(self):
        """A checkpoint's write: an abort (a second signal's) waits for its end."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1
        if self._abort_after_save and not self._saving:
            self.aborted = True
            raise KeyboardInterrupt

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            STOPPING.set_after(STOP_GRACE_S)
            _say(f"{name}: finishing {self.doing} (what waits on a tool or the rollout is given up after "
                 f"{STOP_GRACE_S:g} s; again to stop sooner)")
            return
        STOPPING.set()
        if not self.urgent:
            self.urgent = True
            self._fuse = threading.Timer(ABORT_S, os.kill, (os.getpid(), signum))
            self._fuse.daemon = True
            self._fuse.start()
            _say(f"{name}: giving up on tools and the rollout now; saving the last step done if that takes "
                 f"less than {ABORT_S:g} s, else aborting (again to abort at once)")
            return
        if self._saving and not self._abort_after_save:
            self._abort_after_save = True
            _say(f"{name}: aborting once the checkpoint under way is written (again to abort it too)")
            return
        self.aborted = True
        raise KeyboardInterrupt

    def _defuse(self) -> None:
        if self._fuse is not None:
            self._fuse.cancel()


def _say(line: str) -> None:
    os.write(2, f"{datetime.now():%H:%M:%S} | WARNING | {line}\n".encode())


def default_output_dir(cfg: XConfig) -> Path:
    return Path("runs") / f"{cfg.name or 'run'}-{datetime.now():%Y%m%d-%H%M%S}"


def run(cfg: XConfig, output_dir: str | Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Train as ``cfg`` says; returns (and writes) ``summary.json``.

    The run directory is checked, created and locked before anything starts (``xrlhf.rundir``):
    a path that cannot be one, a live run writing there, or a run that cannot be continued as
    asked raises ``UserError`` (one line each).

    Raises:
        Interrupted: after a signal (a checkpoint was written).
        WorkerDiedError: a worker died and no restart was left.
    """
    # absolute: workers write their state by the paths the driver hands them, from their own cwd
    out = (Path(output_dir) if output_dir else default_output_dir(cfg)).absolute()
    make_output_dir(out, resume)
    with RunLock(out) as lock:  # held until Ray is down and the report written
        start = check_output_dir(out, cfg, resume)
        begin_attempt(out, start)
        atomic_write(out / "config.yaml", dump_config(resolved_config(cfg)))
        return _run_locked(cfg, out, lock, resume=start not in (NEW, AGAIN))


def _run_locked(cfg: XConfig, out: Path, lock: RunLock, resume: bool) -> dict[str, Any]:
    """``run`` in its locked directory: the sinks, the healing loop, and the clean-up however it ends."""
    sink = logger.add(out / "train.log", level="DEBUG")
    tracker = Tracker(out, cfg.logging, cfg.name or out.name, cfg.model_dump(mode="json"), lock=lock)
    healing = Healing(cfg.fault_tolerance.max_restarts)
    import ray

    ray_was_up = ray.is_initialized()  # else a Ray the run starts, reused by its restarts, stopped at its end
    stopped = False
    try:
        with StopRequest() as stop:
            while True:
                try:
                    return _run_once(cfg, out, tracker, stop, resume, healing)
                except WorkerDiedError as e:
                    if healing.left <= 0:
                        raise
                    _restart_from_checkpoint(e, out, healing)
                    resume = True
    except Interrupted:
        stopped = True
        raise
    except KeyboardInterrupt:
        stopped = True
        ckpt = any_checkpoint(out)
        logger.warning("aborted by a second signal: nothing of the current step was saved; "
                       + (f"the last checkpoint is {ckpt}" if ckpt else "there is no checkpoint to resume from"))
        raise
    finally:
        tracker.close()
        # a stopped run's report is written by its --resume (or `xrlhf report`): seconds of plotting saved here
        if cfg.logging.report and not stopped and (out / "metrics.jsonl").is_file():
            from xrlhf.report import write_report

            try:
                write_report(out)
            except Exception as e:  # noqa: BLE001 - the report must never hide the run's own outcome
                logger.warning(f"report.md not written: {e}")
        logger.remove(sink)
        if not ray_was_up and ray.is_initialized():
            from xrlhf.coordinator.coordinator import shutdown_ray

            shutdown_ray()  # and the fork server started with it
        elif not ray_was_up:
            from xrlhf.coordinator.forkserver import SERVER

            SERVER.stop()  # started for a Ray that never came (an error before it)


def _restart_from_checkpoint(error: WorkerDiedError, out: Path, healing: Healing) -> None:
    """Log and record a restart of every worker from the last complete checkpoint (the next
    ``_run_once`` resumes there; with none, the run starts again: deterministic, so exact too)."""
    ckpt = resume_checkpoint(out)
    start = checkpoint_step(ckpt) if ckpt is not None else 0
    at = error.step if error.step is not None else start + 1
    redone = f"steps {start + 1}..{at}" if at > start + 1 else f"step {at}"
    where = f"checkpoint {ckpt.name}" if ckpt is not None else "the start (no checkpoint yet)"
    healing.record(error, f"every worker from {where}", 0.0, redone, step=at, from_step=start, t0=time.time())
    logger.warning(f"{error} (during step {at}); restarting every worker from {where}, redoing {redone} "
                   f"({len(healing.events)}/{healing.max_restarts})")


def write_pids(out: Path, pids: dict[str, list[int]]) -> None:
    """``workers.json``: each handle's worker process ids, in rank order, rewritten after a restart
    in place. Written aside, then renamed, so that a reader (``benchmarks.recovery.healing``'s fault
    injector, a person's watch script) never reads a half-written file: one did in CI."""
    atomic_write(out / "workers.json", json.dumps(pids))


def _healed(healing: Healing) -> None:
    """A restart from a checkpoint is over once the workers are back: its event gets its time."""
    last = healing.events[-1] if healing.events else None
    if last is not None and "t0" in last:
        last["recover_s"] = round(time.time() - last.pop("t0"), 2)
        logger.info(f"workers back after {last['recover_s']:.1f} s (Ray start-up, model loads); resuming from step "
                    f"{last['from_step']}")


def _stop_before_rl(stop: StopRequest, out: Path) -> None:
    """A signal during the warm-up or the Ray start-up stops the run there, not one RL step later."""
    if stop:
        raise stop.interrupted(out)


def _start_point(cfg: XConfig, out: Path, tracker: Tracker, stop: StopRequest, resume: bool, env,
                 tokenizer) -> tuple[Path | None, dict | None, str, dict[str, Any], float]:
    """Where RL starts: the checkpoint resumed from (and its driver state), else the warm-up's
    model (run here, or continued from its checkpoint) or ``policy.model``; ``(ckpt, state,
    model_dir, extra, t_start)``."""
    t_start = time.time()
    had_checkpoints = resume and bool(list_checkpoints(out))
    ckpt = resume_checkpoint(out) if resume else None
    if had_checkpoints and ckpt is None:
        raise UserError(f"--resume: every checkpoint in {checkpoint_dir(out)} is torn (moved to torn-step-*, the "
                        f"warnings above say why); run the same command again to start the run over in {out}")
    state = load_driver_state(ckpt) if ckpt else None
    if state is not None:
        logger.info(f"resuming from {ckpt} (step {state['trainer']['step']})")
        tracker.truncate(state["metrics_offset"])
        return ckpt, state, state["model_dir"], state["extra"], t_start - state["wall_seconds"]
    model_dir, extra = cfg.policy.model, {}
    if not cfg.warmup.steps:
        tracker.truncate(0)
        return ckpt, state, model_dir, extra, t_start
    model_dir, before, t_start = _warmup(cfg, out, tracker, stop, resume, env, tokenizer, t_start)
    if "eval/reward_mean" in before:
        extra["eval_reward_before_warmup"] = before["eval/reward_mean"]
    return ckpt, state, model_dir, extra, t_start


def _warmup(cfg: XConfig, out: Path, tracker: Tracker, stop: StopRequest, resume: bool, env, tokenizer,
            t_start: float) -> tuple[str, dict[str, float], float]:
    """The supervised warm-up, continued from its last checkpoint on ``resume``, saving by the
    run's schedule; ``(model_dir, eval metrics before it, t_start)``."""
    from xrlhf.algorithms.warmup import WarmupSaves, supervised_warmup

    resume_from = resume_checkpoint(out, WARMUP) if resume else None
    offset, wall = 0, 0.0
    if resume_from is not None:
        runner = read_driver_state(resume_from)
        offset, wall = runner["metrics_offset"], runner["wall_seconds"]
    tracker.truncate(offset)
    t_start -= wall
    saves = WarmupSaves(out, SaveSchedule(cfg.checkpoint.every, cfg.checkpoint.every_minutes), cfg.checkpoint.keep,
                        lambda: {"metrics_offset": tracker.offset(), "wall_seconds": time.time() - t_start},
                        resume_from, guard=stop.saving)
    try:
        model_dir, before = supervised_warmup(cfg, env, tokenizer, cfg.policy.model, out, tracker,
                                              stop=lambda: bool(stop), saves=saves)
    except UserCodeAborted as e:  # a stop gave up on the evaluation before it (its env's code was held up)
        logger.warning(f"warm-up: {e}")
        return cfg.policy.model, {}, t_start
    return model_dir, before, t_start


def fork_plan(data: dict[str, Any]) -> dict[str, list]:
    """What the fork server that ``xrlhf run`` starts first imports for the run of config dict
    ``data`` (``coordinator.forkserver.start_early``): its topology's ``forkserver.fork_plan``;
    empty where the config does not validate or its Ray forks nothing."""
    from xrlhf.algorithms import ALGORITHMS
    from xrlhf.coordinator.forkserver import fork_plan as plan_of
    from xrlhf.topology import topology
    from xrlhf.validation import validate_dict

    cfg = validate_dict(data)
    if not cfg.ray.fork_server or cfg.ray.address:
        return {}
    plan = topology(cfg, cfg.policy.model, generate=ALGORITHMS.get(cfg.algorithm.name).uses_generation)
    return plan_of(plan.handles)


def _run_once(cfg: XConfig, out: Path, tracker: Tracker, stop: StopRequest, resume: bool,
              healing: Healing) -> dict[str, Any]:
    from xrlhf.algorithms import ALGORITHMS
    from xrlhf.algorithms.base import run_loop
    from xrlhf.algorithms.rewards import build_reward
    from xrlhf.algorithms.build import build_trainer
    from xrlhf.algorithms.rollout.build import episode_calls
    from xrlhf.coordinator import Coordinator
    from xrlhf.report import write_transcripts
    from xrlhf.topology import topology

    kept = "then checkpoint and stop" if cfg.warmup.steps else "then stop (nothing to save before the first RL step)"
    stop.doing = f"the current warm-up step, {kept}"
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    tokenizer = load_tokenizer(cfg.policy.model)
    ckpt, state, model_dir, extra, t_start = _start_point(cfg, out, tracker, stop, resume, env, tokenizer)
    _stop_before_rl(stop, out)
    algorithm = ALGORITHMS.get(cfg.algorithm.name)
    options = algorithm_options(cfg)
    # compiled kernels go under the run (a worker restarted elsewhere finds them), unless the user chose
    cache = None if os.environ.get("TORCHINDUCTOR_CACHE_DIR") else str(out / "cache")
    plan = topology(cfg, model_dir, algorithm.train_steps(cfg, options), policy_head=algorithm.policy_head,
                    generate=algorithm.uses_generation, concurrent_generate=episode_calls(cfg, env), cache_dir=cache)
    # the one interface through which the run's parts call back into this shell
    hooks = RunHooks(log=tracker, transcripts=lambda step, trajs: write_transcripts(out, step, trajs, tokenizer),
                     workers=lambda pids: write_pids(out, pids))
    coord = Coordinator(plan, healing=healing, keep_ray=True, hooks=hooks)
    trainer = None
    try:
        stop.doing = "the Ray start-up, then stop" + (" (the warm-up is saved)" if cfg.warmup.steps else
                                                      " (nothing to save before the first RL step)")
        coord.start()
        _healed(healing)
        hooks.workers(coord.pids)
        stop.install()
        _stop_before_rl(stop, out)
        stop.doing = "the current step, then checkpoint and exit"
        trainer = build_trainer(cfg, options, coord, env, tokenizer, build_reward(cfg, env, coord), hooks,
                                algorithm=algorithm)
        hooks.running_step = lambda: trainer.step_idx + 1
        if state is not None:
            restore_handles(ckpt, coord.handles)
            trainer.load_state_dict(state["trainer"])
            coord.sync_weights(trainer.step_idx)  # the generator holds the version of the checkpoint
        saves = RLSaves(cfg, out, coord, trainer, tracker, stop, {"model_dir": model_dir, "extra": extra}, t_start)
        hooks.step_end = saves.on_step_end
        result = run_loop(trainer)
        if result is None:
            saves.checkpoint(trainer.step_idx)  # a step given up on: the last one done (unless saved)
            raise stop.interrupted(out)
        final = ""
        if cfg.trainer.save_final:
            final = str((out / "final").resolve())
            coord["policy"].save_pretrained(final)
    except WorkerDiedError as e:
        e.step = trainer.step_idx + 1 if trainer is not None else None
        raise
    finally:
        coord.shutdown(wait_s=1.0 if stop.urgent else 10.0)
    return _finish(out, result, final, extra, healing, coord, trainer, t_start)


class RLSaves:
    """The RL checkpoints of a run (``xrlhf.checkpoint``): what the driver saves beside every
    handle's state, and when (:meth:`on_step_end`, the run's ``RunHooks.step_end``).

    Args:
        fixed: the driver's state that does not change (``model_dir``: the RL start model, ``extra``).
        t_start: the run's start (``time.time()``; earlier on a resume, by the time already run).
    """

    def __init__(self, cfg: XConfig, out: Path, coord, trainer, tracker: Tracker, stop: StopRequest,
                 fixed: dict[str, Any], t_start: float):
        self.cfg, self.out, self.coord, self.trainer, self.tracker, self.stop = cfg, out, coord, trainer, tracker, stop
        self.fixed, self.t_start = fixed, t_start
        self.schedule = SaveSchedule(cfg.checkpoint.every, cfg.checkpoint.every_minutes)
        self.schedule.step = trainer.step_idx if trainer.step_idx else None  # resumed from (saved already)

    def checkpoint(self, step: int) -> None:
        """Save RL step ``step`` (not step 0, nor a step saved already); the warm-up's checkpoints go."""
        if not step or step == self.schedule.step:
            return
        with self.stop.saving():  # a second signal lets it finish
            save_checkpoint(self.out, step, {"trainer": self.trainer.state_dict(), **self.fixed,
                                             "metrics_offset": self.tracker.offset(),
                                             "wall_seconds": time.time() - self.t_start},
                            self.coord.handles, self.cfg.checkpoint.keep)
            remove_checkpoints(self.out, WARMUP)  # superseded: a resume continues from an RL step now
        self.schedule.saved(step)

    def on_step_end(self, step: int) -> bool:
        """After step ``step``: save it when due (a stop always; the last step unless checkpoints are
        off: ``every`` and ``every_minutes`` both 0); True: stop. A stop then gives up at once on
        what still runs (the next batch, a stuck tool)."""
        last = step == self.cfg.trainer.steps and self.schedule.on  # a run killed in the final eval resumes there
        if self.stop or last or self.schedule.due(step):
            self.checkpoint(step)
        if self.stop:
            STOPPING.set()
        return bool(self.stop)


def _finish(out: Path, result: dict[str, Any], final: str, extra: dict[str, Any], healing: Healing, coord,
            trainer, t_start: float) -> dict[str, Any]:
    """Write and return ``summary.json`` of a finished run."""
    summary = {"steps": result["steps"], "wall_seconds": round(time.time() - t_start, 1),
               "eval_reward_initial": result["eval_reward_initial"],
               "eval_reward_final": result["eval_reward_final"], "final_checkpoint": final, **extra,
               **result.get("summary", {}), **({"healed": healing.events} if healing.events else {}),
               "eval_initial": result["eval_initial"], "eval_final": result["eval_final"],
               "startup": coord.startup,  # seconds from Ray's start to each handle up, built, all ready
               # the epoch time the steps' ``timeline`` spans count from: lines them up with outside probes
               "timeline_origin": round(trainer.timeline.origin, 3) if hasattr(trainer, "timeline") else None}
    atomic_write(out / SUMMARY, json.dumps(summary, indent=2))
    logger.info(f"done in {summary['wall_seconds']:.0f}s: eval reward {summary['eval_reward_initial']:.3f} -> "
                f"{summary['eval_reward_final']:.3f}; summary in {out / SUMMARY}")
    return summary
