"""The YAML schema: one pydantic model per section, unknown keys rejected.

Algorithm and environment sections carry a ``name`` plus options that are validated by the
registered class's own ``Config`` model (see ``xrlhf.config.loader``), so a user's own
algorithm or env gets the same strict checking.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator


def yaml_path(info: ValidationInfo | None, default: str) -> str:
    """The YAML path of the section being validated, as ``xrlhf validate`` passes it in the
    validation context (``{"path": ...}``), or ``default`` without one (a section built in code)."""
    return ((info.context or {}).get("path") if info is not None else None) or default


class Strict(BaseModel):
    """Base of every section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_model_dir(v: str | None) -> str | None:
    if v is None:
        return v
    p = Path(v).expanduser()
    if not p.is_dir():
        if p.name == "final":
            raise ValueError(f"no such model directory {v!r}: a run writes it; run the config that trains it "
                             f"first (this config's header names it)")
        preset = next((n for n in ("small", "tiny") if p.name.startswith(n + "-")), None)
        flag = f" --preset {preset}" if preset and preset != "tiny" else ""
        raise ValueError(f"no such model directory {v!r} (build one with: xrlhf make-tiny-model {v}{flag})")
    if not (p / "config.json").is_file():
        raise ValueError(f"{v!r} is not an HF-format model directory (no config.json)")
    return str(p.resolve())


ModelPath = Annotated[str, AfterValidator(check_model_dir)]
"""A local HF-format model directory; validated to exist (no hub, ever)."""


class RayConfig(Strict):
    """Where the Ray workers run. Without ``address`` a local Ray starts."""

    address: str | None = Field(None, description="join an existing cluster, e.g. 'auto' or 'ray://host:10001'")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray (default: all)")
    num_gpus: int | None = Field(None, ge=0)
    log_to_driver: bool = True
    fork_server: bool = Field(
        True, description="a local Ray on Linux starts the workers of handles whose engines import long (vLLM) "
        "from a process that imports them while Ray starts (coordinator/forkserver.py); false: every worker "
        "starts the usual way, importing after Ray's start")


class Resources(Strict):
    """How a model handle is placed: ``ranks`` Ray actors, each with these resources."""

    ranks: int = Field(1, ge=1, description="data-parallel ranks (one Ray actor each)")
    cpus_per_rank: float = Field(1.0, ge=0)
    gpus_per_rank: float = Field(0.0, ge=0)
    colocate_with: str | None = Field(None, description="share the placement group of this handle (e.g. 'policy')")


class Section(BaseModel):
    """Base of the options every backend of a role shares (``TrainConfig`` / ``InferConfig`` /
    ``GenerateConfig``), unknown keys rejected: a backend's ``Options`` derives from its role's and
    adds its own fields (STYLE principle 12). The config file holds the lenient form of each
    (``TrainSection``, ...), which keeps the keys it does not know for the chosen engine; its
    ``Options`` validates them before anything starts (``xrlhf.validation``). So the YAML stays flat."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def engine_fields(self) -> dict[str, Any]:
        """The section as the engine's ``Options`` reads it: shared fields and the backend's own."""
        return self.model_dump(exclude={"resources"})


_LENIENT = ConfigDict(extra="allow", validate_assignment=True)

_TOKEN_BUDGET = ("micro-batches filled to this many tokens (prompt + response, padding excluded), at most "
                 "micro_batch_size rows each; null: on a GPU a budget derived from its free memory (rows not "
                 "capped), elsewhere micro_batch_size rows each")


class TrainConfig(Section):
    """What every train backend reads. ``max_tokens_per_micro_batch`` and the infer forwards'
    budgets are the template's (``TrainEngine.train_step``), so every backend has them."""

    engine: str = Field("hf", description="a train backend ('hf', 'deepspeed') or an import path 'pkg.mod:Class'")
    dtype: Literal["float32", "bfloat16"] = "float32"
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1, description="rows per forward/backward")
    lr_warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    gradient_checkpointing: bool = False
    dropout: bool = Field(False, description="train with the checkpoint's dropout; off by default (TRL's "
                          "disable_dropout): dropout makes the PPO ratio, the KL and the reference comparison noisy")
    max_tokens_per_micro_batch: int | None = Field(None, ge=1, description=_TOKEN_BUDGET)
    infer_micro_batch_size: int | None = Field(None, ge=1, description="rows per forward without gradients (the "
                                               "policy's old logprobs, the critic's values); null: micro_batch_size "
                                               "(not capped under a budget derived for the GPU)")
    infer_max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="the token budget of those forwards, which keep no activations for a backward and "
        "can take more tokens; null: max_tokens_per_micro_batch, or where that is null too on a GPU, a budget "
        "derived from its free memory")


class InferConfig(Section):
    """What every infer backend of a frozen handle (reference, reward model) reads."""

    engine: str = Field("hf", description="an infer backend ('hf', 'deepspeed') or an import path")
    dtype: Literal["float32", "bfloat16"] = "float32"
    micro_batch_size: int = Field(32, ge=1, description="rows per forward")
    max_tokens_per_micro_batch: int | None = Field(None, ge=1, description=_TOKEN_BUDGET)


class GenerateConfig(Section):
    """What every generate backend of the policy reads: its sampling parameters."""

    engine: str = Field("hf", description="a generate backend ('hf', 'vllm') or an import path")
    dtype: Literal["float32", "bfloat16"] = "float32"
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(16, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list, description="default: the model's EOS")
    resources: Resources | None = Field(None, description="where the generators (the 'rollout' handle) run: unset, "
                                        "co-located: one per policy rank, in the policy's bundles (a share of its "
                                        "GPU); set: the split layout, on devices of their own")


class TrainSection(TrainConfig):
    """``<handle>.train`` as the config file holds it: ``TrainConfig`` plus the chosen backend's keys."""

    model_config = _LENIENT


class InferSection(InferConfig):
    """``<handle>.infer`` as the config file holds it: ``InferConfig`` plus the chosen backend's keys."""

    model_config = _LENIENT


class GenerateSection(GenerateConfig):
    """``policy.generate`` as the config file holds it: ``GenerateConfig`` plus the chosen backend's keys."""

    model_config = _LENIENT


class WeightSyncConfig(Strict):
    """How new policy weights reach the generators. Keys besides these are the chosen transport's
    own options (``disk``: ``directory``; ``cuda_ipc``: ``packed``), validated by it before the run
    starts (``xrlhf.weight_sync.transport_errors``)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    transport: str = Field(
        "auto", description="a registered transport (cpu, disk, cuda_ipc, nccl; in_process only between engines "
        "of one process) or auto: generators co-located with the policy -> cuda_ipc on a GPU, cpu otherwise; "
        "generators of their own (policy.generate.resources) -> nccl on GPUs, cpu otherwise")
    bucket_mb: int = Field(256, ge=1, description="weights move in buckets of at most this size")
    verify: bool = Field(False, description="checksum every tensor on both sides; a mismatch stops the run")

    def transport_options(self) -> dict[str, Any]:
        """The chosen transport's own options: the section's keys besides the shared ones."""
        return dict(self.model_extra or {})


class PolicyConfig(Strict):
    model: ModelPath
    train: TrainSection = Field(default_factory=TrainSection)
    generate: GenerateSection = Field(default_factory=GenerateSection)
    resources: Resources = Field(default_factory=Resources)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)


class CriticConfig(Strict):
    model: ModelPath | None = Field(None, description="default: the policy's model, with a new value head")
    train: TrainSection = Field(default_factory=TrainSection)
    resources: Resources = Field(default_factory=lambda: Resources(colocate_with="policy"))


class ReferenceConfig(Strict):
    model: ModelPath | None = Field(None, description="default: the policy's initial model")
    from_policy_base: bool | None = Field(
        None, description="the reference is the policy's base with its LoRA adapters off, computed by the policy's "
        "train engine: no model of its own (default: on when policy.train.lora is set and reference.model is not)")
    infer: InferSection = Field(default_factory=InferSection)
    resources: Resources = Field(default_factory=lambda: Resources(colocate_with="policy"))


class TeacherConfig(Strict):
    """The teacher of on-policy distillation (``algorithm.name: distill``): a frozen model of its
    own, any size, with the policy's tokenizer, that scores the tokens the student samples."""

    model: ModelPath = Field(description="the teacher's HF model directory (same tokenizer as policy.model)")
    infer: InferSection = Field(default_factory=InferSection)
    resources: Resources = Field(default_factory=lambda: Resources(colocate_with="policy"))
    evaluate: bool = Field(True, description="greedy-evaluate the teacher once on the env's held-out prompts (an "
                           "hf generate engine beside its infer engine), so the report shows student and teacher "
                           "side by side")


class RewardConfig(Strict):
    """Where rewards come from: the env's rule, a reward model, or a Python function."""

    source: Literal["env", "model", "function"] = "env"
    model: ModelPath | None = None
    function: str | None = Field(None, description="import path 'pkg.mod:fn' of fn(prompts, responses) -> list[float]")
    infer: InferSection = Field(default_factory=InferSection)
    resources: Resources = Field(default_factory=lambda: Resources(colocate_with="policy"))

    @model_validator(mode="after")
    def _source_needs(self):
        if self.source == "model" and self.model is None:
            raise ValueError("source 'model' needs reward.model: the path of a reward model")
        if self.source == "function" and not self.function:
            raise ValueError("source 'function' needs reward.function: an import path 'pkg.mod:fn'")
        return self


class NamedSection(BaseModel):
    """``name`` plus options validated later by the registered class's ``Config``."""

    model_config = ConfigDict(extra="allow")
    name: str

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class EnvConfig(Strict):
    name: str = Field(description="a registered env or an import path 'pkg.mod:Class'")
    options: dict[str, Any] = Field(default_factory=dict)


class TrainerConfig(Strict):
    """The outer RL loop."""

    steps: int = Field(20, ge=1, description="RL steps (rollout + update)")
    prompts_per_step: int = Field(32, ge=1)
    samples_per_prompt: int = Field(1, ge=1)
    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0: only at start and end)")
    eval_temperature: float = Field(0.0, ge=0, description="0: greedy decoding for evaluation")
    eval_size: int | None = Field(None, ge=1, description="limit the held-out set to N prompts")
    save_final: bool = True


class RefillConfig(Strict):
    """How a batch is filled (``xrlhf.algorithms.rollout.refill``): ``none`` keeps every group of
    one round; ``dynamic_sampling`` (DAPO) drops the groups the algorithm learns nothing from and
    generates more prompts; or a policy of your own by import path. The other keys of the section
    are the policy's own options, validated by it before the run starts."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("none", description="'none', 'dynamic_sampling' (options: max_generated_factor) or "
                      "'pkg.mod:Class' (a subclass of xrlhf.algorithms.rollout.refill.Refill)")

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v


class RolloutConfig(Strict):
    """How batches are produced: how far generation may run ahead of training (``max_staleness``;
    0: the synchronous loop), streamed rewards, and the refill policy."""

    max_staleness: int = Field(0, ge=0, description="how many policy versions a sample may lag the policy it "
                               "trains: 0 = the synchronous loop (generate, then train), 1 = one-step-off "
                               "(batch s+1 generates while step s trains), k = up to k versions behind")
    freshness: Literal["fixed", "latest"] = Field(
        "fixed", description="fixed: batch b is generated with version max(0, b-1-max_staleness) exactly "
        "(numbers independent of timing; exact resume); latest: with the newest weights synced (timing-dependent)")
    in_flight_updates: bool = Field(False, description="latest: new weights land while a batch is being "
                                    "generated (vLLM pause/resume); tokens record the version that sampled them")
    on_update: Literal["continue", "recompute", "abort"] = Field(
        "continue", description="in_flight_updates: what unfinished samples do when weights change: continue "
        "(keep their KV cache), recompute (KV cache recomputed with the new weights), abort (restart the sample)")
    stream_rewards: bool | None = Field(None, description="score each part of a batch as soon as it is "
                                        "generated, while the rest generates; default: on with max_staleness > 0; "
                                        "true: in the synchronous loop too (samples then drawn from per-sample seeds)")
    stream_parts: int = Field(4, ge=1, description="stream_rewards: parts (whole groups each) a batch is "
                              "generated in")
    refill: RefillConfig = Field(default_factory=RefillConfig)
    stall_timeout_s: float = Field(600.0, gt=0, description="a generator that produces nothing for this long "
                                   "is treated as dead")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, v: Any) -> Any:
        if isinstance(v, dict) and "dynamic_sampling" in v:
            raise ValueError("dynamic_sampling is now a refill policy: write refill: {name: dynamic_sampling, "
                             "max_generated_factor: 3.0} (or leave refill out to keep every group)")
        return v


class WarmupConfig(Strict):
    """An optional supervised warm-up of the policy on the env's examples before RL."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    lora: bool = Field(False, description="with policy.train.lora: warm up the LoRA adapters too (merged into the "
                       "model the warm-up writes); default: the warm-up trains every weight and RL's adapters start "
                       "on its result")


class CheckpointConfig(Strict):
    """Periodic checkpoints for exact resume (``xrlhf run ... --resume``): every ``every`` steps or
    ``every_minutes`` after the last one, whichever comes first, at a step's end; the last step
    writes one too, unless both are 0 (checkpoints off: a benchmark of a large model), and a signal
    always does."""

    every: int = Field(0, ge=0, description="write a checkpoint every N RL steps (0: not by steps)")
    every_minutes: float = Field(10.0, ge=0, description="write a checkpoint at the first step's end N minutes "
                                 "after the last one (0: not by time): what a SIGKILL can cost at most, plus a step")
    keep: int = Field(2, ge=1, description="keep the last K checkpoints")


class FaultToleranceConfig(Strict):
    """What happens when something goes wrong mid-run."""

    max_restarts: int = Field(3, ge=0, description="heal up to N times: a dead (or frozen) worker's handle is "
                              "restarted in place when it holds no training state (reference, reward model, the "
                              "split layout's generators), else every worker restarts from the last checkpoint; "
                              "0: a dead worker stops the run (docs/healing.md)")
    collective_timeout_s: float = Field(600.0, gt=0, description="a collective of a handle's ranks (gradient "
                                        "all-reduce, ZeRO gathers) that waits this long for a peer fails, and the "
                                        "worker is healed as a dead one (a hang where every peer is alive)")
    heartbeat_timeout_s: float = Field(60.0, ge=0, description="a worker that answers no heartbeat for this long "
                                       "(SIGSTOP, a hung process) is killed and healed as a dead one; 0: no heartbeats")
    max_bad_steps: int = Field(3, ge=1, description="abort after K consecutive steps with NaN/inf loss or rewards")
    reward_errors: Literal["fail", "zero"] = Field("fail", description="a reward function that raises: stop, or score 0")


class LoggingConfig(Strict):
    """Where metrics go besides ``metrics.jsonl``."""

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "xrlhf"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    report: bool = Field(True, description="write report.md and PNG plots at the end")
    memory_timeline: bool | None = Field(None, description="each step's memory by phase (generate, sleep, infer, "
                                         "train, sync) and handle as memory/<phase>/<handle>_gib metrics, a table and "
                                         "plots/memory.png in the report; default: on when a handle has a GPU")


class XConfig(Strict):
    """The whole run."""

    name: str | None = None
    seed: int = 0
    ray: RayConfig = Field(default_factory=RayConfig)
    env: EnvConfig
    policy: PolicyConfig
    critic: CriticConfig | None = None
    reference: ReferenceConfig | None = Field(default_factory=ReferenceConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    teacher: TeacherConfig | None = Field(None, description="the teacher of algorithm distill")
    algorithm: NamedSection = Field(default_factory=lambda: NamedSection(name="ppo"))
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    # the memory plan (``xrlhf plan``) refuses a GPU run it says cannot fit; false runs it anyway
    # (a model is a model: where it is wrong, say so with the run's memory timeline)
    check_plan: bool = True
    layout: Literal["auto"] | None = Field(
        None, description="auto: xrlhf run / validate place the handles as the fastest layout that xrlhf plan finds "
        "on this machine's GPUs (ray.num_gpus of them) before validating; a value the config or an override "
        "sets is kept (docs/plan.md); null: as written")

    def engine_sections(self) -> list[tuple[str, str, Section]]:
        """Every engine section the run uses: ``(yaml_path, role, section)``."""
        out: list[tuple[str, str, Section]] = [("policy.train", "train", self.policy.train),
                                               ("policy.generate", "generate", self.policy.generate)]
        if self.critic is not None:
            out.append(("critic.train", "train", self.critic.train))
        if self.reference is not None:
            out.append(("reference.infer", "infer", self.reference.infer))
        if self.reward.source == "model":
            out.append(("reward.infer", "infer", self.reward.infer))
        if self.teacher is not None:
            out.append(("teacher.infer", "infer", self.teacher.infer))
        return out

    @model_validator(mode="after")
    def _cross_checks(self):
        handles = {"policy", "critic", "reference", "reward", "teacher"}
        for h in ("critic", "reference", "reward", "teacher"):
            sec = getattr(self, h)
            if sec is not None and sec.resources.colocate_with not in (None, *handles - {h}):
                raise ValueError(f"{h}.resources.colocate_with: unknown handle "
                                 f"{sec.resources.colocate_with!r}; valid: {', '.join(sorted(handles - {h}))}")
        errors = layout_errors(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self


def layout_errors(cfg: XConfig) -> list[str]:
    """Checks of the generation layout (the transport against it: ``weight_sync.transport_errors``)."""
    g, errors = cfg.policy.generate, []
    if g.resources is not None and g.resources.colocate_with not in (None, "policy"):
        errors.append(f"policy.generate.resources.colocate_with: the generators share the policy's bundles "
                      f"('policy') or have their own (leave it out), not {g.resources.colocate_with!r}'s")
    return errors
