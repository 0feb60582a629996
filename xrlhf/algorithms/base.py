"""The trainer loops: ``Trainer`` (what every algorithm shares) and ``RLTrainer`` (online).

``run_loop(trainer)`` is the outer loop of every algorithm: evaluate, ``steps`` x ``step()``,
evaluate. ``Trainer`` is what every algorithm's trainer shares: the evaluation, the memory marks,
the trainer state for exact resume, the one progress line. ``RLTrainer`` here is the one online
loop (rollout -> reward -> its ``update`` part -> weight sync); an online algorithm is a
registration (``algorithms/spec.py:Algorithm``) that says which ``update`` it builds. The
sibling ``OfflineTrainer`` (``algorithms/offline.py``: the next rows of a dataset -> its step
part; DPO, offline KTO, the reward model) is the loop of the offline registrations.

Trainers talk to the models through the typed seam of ``algorithms/handles.py`` only
(``self.policy.generate``, ``.infer``, ``.train_step``), never to Ray or to engines, and pass
batches of any size: the handles' dispatch splits and pads them over the ranks.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Protocol

import torch
from loguru import logger
from pydantic import BaseModel

from xrlhf.engines.handles import Handles
from xrlhf.algorithms.off_policy import staleness_stats
from xrlhf.algorithms.run import RunSpec, TrainerParts
from xrlhf.algorithms.rollout import Producer, Rollout
from xrlhf.algorithms.rollout.refill import REFILLS, refill_errors
from xrlhf.config.schema import XConfig
from xrlhf.data.batch import Batch
from xrlhf.envs import Env, Prompt
from xrlhf.utils.bounded import STOPPING, UserCodeAborted
from xrlhf.utils.errors import NonFiniteError
from xrlhf.utils.memory import memory_metrics
from xrlhf.utils.registry import Registry
from xrlhf.utils.timeline import Timeline
from xrlhf.utils.run_hooks import RunHooks

ALGORITHMS: Registry[Any] = Registry("algorithm")
"""Name -> an ``Algorithm`` (``algorithms/spec.py``; its ``loop`` runs it)."""

EPISODE_KEYS = (("episode/turns_mean", "turns"), ("episode/tool_calls_mean", "tool_calls"),
                ("episode/tool_errors_mean", "tool_errors"), ("episode/tool_timeouts_mean", "tool_timeouts"),
                ("episode/step_timeouts_mean", "step_timeouts"), ("episode/truncated_frac", "truncated"))
"""What the progress line shows of an episode env's rollout, when its metrics have it."""

RL_PROGRESS = (("reward/mean", "reward"), ("kl/mean", "kl"), ("policy/loss", "pg_loss"),
               ("critic/loss", "vf_loss"), ("policy/entropy", "entropy"))
"""The progress line's keys of an online step (an ``Algorithm``'s default ``progress_keys``)."""


def register_algorithm(name: str):
    """Decorator registering an ``Algorithm`` under ``algorithm.name: <name>``;
    ``register_algorithm(name)(obj)`` registers an object."""
    return ALGORITHMS.register(name)


class Trainer(ABC):
    """What every algorithm's trainer shares; ``run_loop`` (``fit``) drives its ``step``.

    Built by ``algorithms.build.build_trainer`` (the one place that reads the config for it).

    Args:
        run: what the trainer reads of the run (``RunSpec``: seed, steps, ...).
        options: this algorithm's validated ``Config`` (``self.options``).
        parts: the evaluation and the rollout's builders (``TrainerParts``).
        handles: the run's models (``Handles``: ``policy``, ``generator``, ``critic``,
            ``reference``, ``reward``, ``sync_weights()``, ``end_rollout()``).
        env: the environment.
        tokenizer: the policy's tokenizer.
        reward: ``(prompts, responses, batch) -> (scores [B], metrics)``.
        hooks: what the steps tell the program around them (``RunHooks``: each metrics row,
            the end of each step, transcripts of evaluated episodes).
    """

    progress_keys: ClassVar[tuple[tuple[str, str], ...]] = ()
    """``(metric key, short name)`` shown in the progress line when a step's metrics have them
    (then ``eval/reward_mean`` as ``eval``, generation tokens/s and the step time)."""

    def __init__(self, run: RunSpec, options: BaseModel, parts: TrainerParts, handles: Handles, env: Env,
                 tokenizer, reward: Callable[[list[Prompt], list[str], Batch], tuple[torch.Tensor, dict]] | None,
                 hooks: RunHooks):
        self.run, self.options, self.parts, self.handles, self.env, self.tok = run, options, parts, handles, env, tokenizer
        self.reward, self.hooks = reward, hooks
        self.policy = handles.policy
        self.gen_handle = handles.generator  # split layout: the 'rollout' handle
        self.critic = handles.critic
        self.reference = handles.reference
        self.data_pos = 0
        self.step_idx = 0
        self.bad_steps = 0
        self.initial_eval: dict[str, float] | None = None
        self.generator = torch.Generator().manual_seed(run.seed)
        self.timeline = Timeline()
        """Spans of the step's work by lane (``utils.timeline``); each step's row carries them."""
        self.memory_timeline = run.memory_timeline
        self._memory: dict[str, float] = {}
        self.throughput = parts.throughput
        """Tokens per second per GPU and the train phase's MFU (GPU runs; the GPUs seen in ``memory_marks``)."""
        self.evaluator = parts.evaluator
        runner_for = self.evaluator.runner_for
        self.episodes = runner_for(self.gen_handle) if runner_for is not None and self.gen_handle is not None else None
        """Runs the samples of an episode env (``algorithms.rollout.episodes``); ``None`` for one-turn envs."""

    # -- the loop ---------------------------------------------------------------------------
    @abstractmethod
    def step(self) -> dict[str, float]:
        """One training step (one or more optimizer steps); returns its metrics."""

    def fit(self) -> dict[str, Any] | None:
        """``run_loop(self)``: the steps from ``step_idx + 1``; eval rewards before and after."""
        return run_loop(self)

    def close(self) -> None:
        """The end of ``run_loop``, however it ends (the online loop stops its producer)."""

    def step_evaluation(self, step: int) -> dict[str, float]:
        """The evaluation after step ``step``; none in a stopping run (the step's sync may have
        been skipped), and none when the stop gives up on it (its user code was held up)."""
        try:
            if not STOPPING.is_set():
                return self.evaluate()
        except UserCodeAborted as e:
            logger.warning(f"step {step}: {e}")
        logger.warning(f"step {step}: no evaluation (the run is stopping)")
        return {}

    def evaluates_after(self, step: int) -> bool:
        """Whether ``fit`` evaluates after step ``step`` (``trainer.eval_every``; the last step's
        evaluation is the final one)."""
        t = self.run
        return bool(t.eval_every) and step % t.eval_every == 0 and step != t.steps

    def mark_memory(self, phase: str) -> None:
        """The end of a step's ``phase``: every handle's memory since the previous mark becomes
        ``memory/<phase>/...`` metrics of the step (``utils.memory``; ``logging.memory_timeline``)."""
        self._memory.update(self.memory_marks(phase))

    def take_memory(self) -> dict[str, float]:
        """The step's ``memory/...`` metrics marked so far, cleared for the next step."""
        marks, self._memory = self._memory, {}
        return marks

    def memory_marks(self, phase: str) -> dict[str, float]:
        """``memory/<phase>/...``: every handle's memory since the previous mark (none when the
        memory timeline is off)."""
        if not self.memory_timeline:
            return {}
        stats = self.handles.memory()
        self.throughput.see(stats)
        return memory_metrics(phase, stats)

    def evaluate(self) -> dict[str, float]:
        """The generator's answers to the env's held-out prompts, scored (``Evaluator``)."""
        if self.episodes is not None:
            step, keep = self.step_idx, self.hooks.transcripts
            return self.evaluator.evaluate(self.gen_handle, self.episodes,
                                           keep=None if keep is None else (lambda trajs: keep(step, trajs)))
        return self.evaluator.evaluate(self.gen_handle)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state for exact resume (handles save theirs separately)."""
        return {"step": self.step_idx, "data_pos": self.data_pos, "generator": self.generator.get_state(),
                "initial_eval": self.initial_eval, "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_idx, self.data_pos = state["step"], state["data_pos"]
        self.generator.set_state(state["generator"])
        self.initial_eval, self.bad_steps = state["initial_eval"], state["bad_steps"]

    def progress_line(self, step: int, m: dict[str, float]) -> str:
        """``step i/n | <short> <value> ... | eval <value> | <tok/s> | <seconds>``, from ``progress_keys``."""
        keys = (*self.progress_keys, *EPISODE_KEYS, ("eval/reward_mean", "eval"))
        parts = [f"step {step}/{self.run.steps}"] + [f"{short} {m[k]:.3f}" for k, short in keys if k in m]
        if "perf/gen_tokens_per_s" in m:
            parts.append(f"{m['perf/gen_tokens_per_s']:.0f} tok/s")
        if "perf/tokens_per_s_per_gpu" in m:
            parts.append(f"{m['perf/tokens_per_s_per_gpu']:.0f} tok/s/GPU")
        if "perf/train_mfu" in m:
            parts.append(f"train MFU {m['perf/train_mfu']:.0%}")
        return " | ".join(parts + [f"{m['time/step_s']:.2f}s"])


def run_loop(trainer: Trainer) -> dict[str, Any] | None:
    """Every trainer's outer loop: evaluate, the steps from ``step_idx + 1`` to ``run.steps``
    (each ``trainer.step()``, its metrics row logged), evaluate; returns eval rewards before and
    after (and the evaluator's ``summary`` of them where it has one).

    ``hooks.step_end(step)`` runs after each step (checkpoints, signals); when it returns True
    the loop stops early and returns ``None``. So it does when a stopping run
    (``utils.bounded.STOPPING``) gives up on a step whose rollout was held up (``step_idx`` is
    then the last step done), or on the evaluation before or after the steps.
    ``trainer.close()`` runs however the loop ends.
    """
    try:
        return _loop(trainer)
    except UserCodeAborted as e:
        logger.warning(f"{e}; the run stops after step {trainer.step_idx}")
        return None
    finally:
        trainer.close()


def _loop(trainer: Trainer) -> dict[str, Any] | None:
    t = trainer.run
    if trainer.initial_eval is None:
        logger.info("eval before RL on the held-out split ...")
        trainer.initial_eval = trainer.evaluate()
        logger.info(f"eval before training: reward {trainer.initial_eval['eval/reward_mean']:.3f}")
        trainer.hooks.log({"step": 0, **trainer.initial_eval})
    for step in range(trainer.step_idx + 1, t.steps + 1):
        t0 = time.time()
        metrics = trainer.step()
        metrics.update(trainer.take_memory())
        trainer.step_idx = step
        if trainer.evaluates_after(step):
            metrics.update(trainer.step_evaluation(step))
        metrics["time/step_s"] = time.time() - t0
        metrics.update(trainer.throughput.metrics(metrics))
        trainer.hooks.log({"step": step, **metrics, "timeline": trainer.timeline.drain()})
        logger.info(trainer.progress_line(step, metrics))
        if trainer.hooks.step_end(step):
            return None
    final = trainer.evaluate()
    trainer.hooks.log({"step": t.steps, **final})
    initial = trainer.initial_eval
    logger.info(f"eval after training: reward {final['eval/reward_mean']:.3f} "
                f"(before {initial['eval/reward_mean']:.3f})")
    result = {"eval_reward_initial": initial["eval/reward_mean"], "eval_reward_final": final["eval/reward_mean"],
              "eval_initial": initial, "eval_final": final, "steps": t.steps}
    summary = getattr(trainer.evaluator, "summary", None)  # (an offline evaluator's, over the result)
    if summary is not None:
        result["summary"] = summary(result)
    return result


class RLTrainer(Trainer):
    """Online RL: each ``step`` takes batch ``s`` from the producer, runs ``update`` (the
    algorithm's part, built by its ``Algorithm.parts``) and publishes version ``s`` to the
    generators (``algorithms/rollout``).

    ``rollout.max_staleness`` only changes when the producer may start a batch: 0 is the
    synchronous loop (generate, train, sync), above 0 generation runs ahead of training.

    Args (besides ``Trainer``'s):
        algorithm: the registration (``algorithms/spec.py:Algorithm``): its ``parts(options,
            trainer)`` builds ``update``; its ``progress_keys`` are the progress line's.
    """

    def __init__(self, *args, algorithm, **kwargs):
        super().__init__(*args, **kwargs)
        self.algorithm = algorithm
        self.progress_keys = algorithm.progress_keys
        self.collector = self.parts.collector(self.gen_handle, self.group_filter, self.timeline, self.episodes)
        self.producer: Producer | None = None
        self._producer_state: dict[str, Any] | None = None
        self.update: Update = algorithm.parts(self.options, self)
        """The algorithm: from a scored rollout to updated policy (and critic) weights."""

    def group_filter(self, scores: torch.Tensor) -> bool:
        """A refill policy's judgement of a group of ``n`` samples (``scores`` ``[n]``): the
        update's ``keeps_group``."""
        return self.update.keeps_group(scores)

    def evaluate(self) -> dict[str, float]:
        """The generator's evaluation, and what the update adds to it (distillation: the teacher's)."""
        return {**super().evaluate(), **self.update.evaluation()}

    def step(self) -> dict[str, float]:
        """One RL step: batch ``s``, the algorithm's update, then version ``s`` published.

        A step whose rewards or loss are not finite changes nothing (the engines skip a
        non-finite optimizer step; the same weights are published) and is counted;
        ``fault_tolerance.max_bad_steps`` of them in a row abort the run.
        """
        s = self.step_idx + 1
        producer = self._start_producer()
        timings: dict[str, float] = {}
        with self.timeline.span("trainer", "wait"):
            rollout = producer.get(s)
        timings["time/wait_rollout_s"] = producer.waited_s
        if not any(k.startswith("memory/generate/") for k in rollout.metrics):  # (the producer's idle call marks it)
            self.mark_memory("generate")
        metrics: dict[str, float] = staleness(rollout.batch, s - 1)
        finite = bool(torch.isfinite(rollout.batch["scores"]).all())
        if finite:
            t0 = time.time()
            with self.timeline.span("trainer", "update"):
                metrics.update(self.update(rollout, timings))
            timings["time/update_s"] = time.time() - t0
            self.mark_memory("train")
        self.publish(s, timings)
        self.step_idx = s  # (``fit`` says so too; a caller may also drive ``step`` itself)
        metrics = {**rollout.metrics, **metrics, **timings, "prompts": rollout.prompt_indices()}
        if not finite:
            return self._bad_step(s, "rewards", metrics)
        if any(metrics.get(k, 0) > 0 for k in ("policy/skipped", "critic/skipped")):
            return self._bad_step(s, "loss", metrics)
        self.bad_steps = 0
        return metrics

    def publish(self, s: int, timings: dict[str, float]) -> None:
        """Version ``s`` to the generators, once the schedule allows (``Producer.before_sync``);
        not at all in a stopping run that gives up waiting (the checkpoint holds the weights, and
        a resume syncs them)."""
        producer = self.producer
        try:
            with self.timeline.span("trainer", "wait"):
                timings["time/wait_generation_s"] = producer.before_sync(s)
        except UserCodeAborted as e:
            logger.warning(f"step {s}: {e}; version {s} not synced to the generators (the run is stopping)")
            return
        with self.timeline.span("trainer", "sync"):
            timings["time/sync_s"] = self.handles.sync_weights(s)
        self.mark_memory("sync")
        producer.after_sync(s, hold=self.evaluates_after(s))  # the evaluation uses the generator next

    def step_evaluation(self, step: int) -> dict[str, float]:
        try:
            return super().step_evaluation(step)
        finally:  # the generator was held awake for it (``publish``), evaluated or not
            if self.producer is not None:
                self.producer.release()

    def _start_producer(self) -> Producer:
        if self.producer is None:
            st = self._producer_state or {"next": self.step_idx + 1, "data_pos": self.data_pos, "queue": {}}
            self.producer = self.parts.producer(self.collector, {**st, "synced": self.step_idx},
                                                self._generator_idle).start()
            self._producer_state = None
        return self.producer

    def _generator_idle(self) -> dict[str, float]:
        """Nothing to generate until the next sync: co-located generators free their memory.
        Returns the batch's ``time/sleep_s`` and the memory at the end of generation and of the sleep."""
        metrics = self.memory_marks("generate")
        t0 = time.time()
        self.handles.end_rollout()
        return {**metrics, "time/sleep_s": time.time() - t0, **self.memory_marks("sleep")}

    def close(self) -> None:
        if self.producer is not None:  # a stopping run does not wait for a generate call under way
            self.producer.stop(timeout=0.5 if STOPPING.is_set() else 5.0)

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), **self.update.state_dict()}
        if self.producer is not None:  # the queued batches and where the producer goes on
            state["producer"] = self.producer.state_dict(self.step_idx)
            state["data_pos"] = state["producer"]["data_pos"]
        elif self._producer_state is not None:
            state["producer"] = self._producer_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.update.load_state_dict(state)
        self._producer_state = state.get("producer")

    def _bad_step(self, s: int, what: str, metrics: dict[str, float]) -> dict[str, float]:
        self.bad_steps += 1
        limit = self.run.max_bad_steps
        logger.warning(f"step {s}: non-finite {what}; step skipped ({self.bad_steps}/{limit} in a row)")
        if self.bad_steps >= limit:
            raise NonFiniteError(f"{self.bad_steps} consecutive steps with non-finite {what}; stopping "
                                 f"(fault_tolerance.max_bad_steps = {limit})")
        return {**metrics, "skipped_step": 1.0}


class Update(Protocol):
    """An online algorithm's update, the part ``RLTrainer`` holds: ``update(rollout, timings)``
    trains on a scored rollout and returns its metrics; ``keeps_group(scores)`` judges a group
    for a refill policy; ``evaluation()`` adds to every evaluation; ``state_dict`` keys are
    merged into the trainer's."""

    def __call__(self, rollout: Rollout, timings: dict[str, float]) -> dict[str, float]: ...

    def keeps_group(self, scores: torch.Tensor) -> bool: ...

    def evaluation(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def differing_rewards(scores: torch.Tensor) -> bool:
    """The default ``keeps_group``: keep a group only if its rewards differ (equal rewards give a
    group-relative estimator no signal)."""
    return bool(scores.max() > scores.min())


def staleness(batch: Batch, version: int) -> dict[str, float]:
    """``staleness/min|mean|max``: how many versions the response tokens of ``batch`` lag the
    policy ``version`` they train (from ``token_versions`` ``[B, R]`` and ``response_mask``)."""
    if "token_versions" not in batch or not bool((batch["response_mask"] > 0).any()):
        return {}
    return staleness_stats(batch["token_versions"], batch["response_mask"], version)


def check_mini_batch(cfg: XConfig, mini_batch_size: int) -> list[str]:
    """Checks of an ``algorithm.mini_batch_size`` that cuts each rollout into optimizer steps:
    it must divide the rollout batch (``trainer.prompts_per_step * trainer.samples_per_prompt``),
    so that every optimizer step sees as many samples. (The ranks need not divide it: the
    handles' dispatch pads.)"""
    errors = []
    batch = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    if batch % mini_batch_size:
        errors.append(f"algorithm.mini_batch_size: {mini_batch_size} must divide the rollout batch "
                      f"(trainer.prompts_per_step * trainer.samples_per_prompt = {batch})")
    return errors


def common_errors(spec: Any, cfg: XConfig) -> list[str]:
    """The checks every algorithm shares (``spec``: an ``Algorithm``, read for ``needs_critic``,
    ``uses_teacher`` and the rollout's flags)."""
    errors = []
    if spec.needs_critic and cfg.critic is None:
        errors.append(f"critic: algorithm {cfg.algorithm.name!r} needs a critic section (critic: {{}} "
                      f"uses the policy's model with a new value head)")
    if cfg.teacher is not None and not spec.uses_teacher:
        errors.append(f"teacher: algorithm {cfg.algorithm.name!r} uses no teacher (algorithm distill does); "
                      f"remove the section")
    errors += _check_reward_source(cfg)
    errors += _check_rollout(spec, cfg)
    return errors


def _check_rollout(spec: Any, cfg: XConfig) -> list[str]:
    """The ``rollout`` section against the algorithm (each line: the path and the fix)."""
    r, errors = cfg.rollout, []
    if r.max_staleness > 0 and not spec.learns_off_policy:
        errors.append(f"rollout.max_staleness: algorithm {cfg.algorithm.name!r} cannot learn from samples of "
                      f"older policies; set 0")
    if r.freshness == "latest" and r.max_staleness == 0:
        errors.append("rollout.freshness: 'latest' needs rollout.max_staleness >= 1 (0 is the synchronous loop)")
    if r.in_flight_updates and (r.freshness != "latest" or r.max_staleness == 0):
        errors.append("rollout.in_flight_updates: needs rollout.freshness: latest and max_staleness >= 1 (with "
                      "'fixed' every batch is generated by exactly one version)")
    if "on_update" in r.model_fields_set and not r.in_flight_updates:
        errors.append("rollout.on_update: only used with rollout.in_flight_updates: true")
    refill = r.refill.model_dump()
    problems = refill_errors(refill)
    errors += problems
    if not problems and refill["name"] != "none":
        need = REFILLS.get(refill["name"]).min_samples_per_prompt
        if cfg.trainer.samples_per_prompt < need:
            errors.append(f"rollout.refill: {refill['name']!r} judges the samples of a prompt together, so it needs "
                          f"trainer.samples_per_prompt >= {need}, got {cfg.trainer.samples_per_prompt}")
        if not spec.uses_generation or not issubclass(spec.loop, RLTrainer):
            errors.append(f"rollout.refill: algorithm {cfg.algorithm.name!r} does not generate")
    return errors


def _check_reward_source(cfg: XConfig) -> list[str]:
    """An env without rule rewards (``reward_source = "model"``) needs a reward model or function."""
    from xrlhf.envs import ENVS

    try:
        env_cls = ENVS.get(cfg.env.name)
    except KeyError:
        return []  # reported by the loader under env.name
    if getattr(env_cls, "reward_source", "rule") == "model" and cfg.reward.source == "env":
        return [f"reward.source: env {cfg.env.name!r} has no rule reward; set reward.source: model with "
                f"reward.model: <a reward model directory> (xrlhf run configs/rm.yaml trains one), or "
                f"reward.source: function with reward.function: pkg.mod:fn"]
    return []
