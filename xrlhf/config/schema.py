"""The YAML schema: one pydantic model per section, unknown keys rejected.

Algorithm and environment sections carry a ``name`` plus options that are validated by the
registered class's own ``Config`` model (see ``xrlhf.config.loader``), so a user's own
algorithm or env gets the same strict checking.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Base of every section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_model_dir(v: str | None) -> str | None:
    if v is None:
        return v
    p = Path(v).expanduser()
    if not p.is_dir():
        raise ValueError(f"no such model directory {v!r} (build one with: xrlhf make-tiny-model {v})")
    if not (p / "config.json").is_file():
        raise ValueError(f"{v!r} is not an HF-format model directory (no config.json)")
    return str(p.resolve())


ModelPath = Annotated[str, AfterValidator(_check_model_dir)]
"""A local HF-format model directory; validated to exist (no hub, ever)."""


class RayConfig(Strict):
    """Where the Ray workers run. Without ``address`` a local Ray starts."""

    address: str | None = Field(None, description="join an existing cluster, e.g. 'auto' or 'ray://host:10001'")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray (default: all)")
    num_gpus: int | None = Field(None, ge=0)
    log_to_driver: bool = True


class Resources(Strict):
    """How a model handle is placed: ``ranks`` Ray actors, each with these resources."""

    ranks: int = Field(1, ge=1, description="data-parallel ranks (one Ray actor each)")
    cpus_per_rank: float = Field(1.0, ge=0)
    gpus_per_rank: float = Field(0.0, ge=0)
    colocate_with: str | None = Field(None, description="share the placement group of this handle (e.g. 'policy')")


class TrainConfig(Strict):
    """The train engine of a handle."""

    engine: str = Field("hf", description="'hf', 'deepspeed' or an import path 'pkg.mod:Class'")
    dtype: Literal["float32", "bfloat16"] = "float32"
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    gradient_checkpointing: bool = False
    engine_options: dict[str, Any] = Field(default_factory=dict, description="passed to a custom engine as is")
    # DeepSpeed only (engine: deepspeed); checked by xrlhf.config.deepspeed at validation.
    zero_stage: Literal[0, 1, 2, 3] | None = Field(None, description="deepspeed: ZeRO stage (default 2)")
    offload_optimizer: bool = Field(False, description="deepspeed: optimizer states in CPU memory")
    offload_params: bool = Field(False, description="deepspeed: parameters in CPU memory (ZeRO 3)")
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="deepspeed: extra config keys, "
                                      "merged over the generated ones (conflicts are errors)")


class InferConfig(Strict):
    """The infer engine of a frozen handle (reference, reward model)."""

    engine: str = "hf"
    dtype: Literal["float32", "bfloat16"] = "float32"
    micro_batch_size: int = Field(32, ge=1)
    engine_options: dict[str, Any] = Field(default_factory=dict)
    # DeepSpeed only (engine: deepspeed): ZeRO 3 partitions the frozen weights across ranks.
    zero_stage: Literal[0, 3] | None = Field(None, description="deepspeed: 0 (replicated, default) or 3")
    offload_params: bool = Field(False, description="deepspeed: parameters in CPU memory (ZeRO 3)")
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="deepspeed: extra config keys")


class GenerateConfig(Strict):
    """The generate engine of the policy and its sampling parameters."""

    engine: str = "hf"
    dtype: Literal["float32", "bfloat16"] = "float32"
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(16, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list, description="default: the model's EOS")
    micro_batch_size: int = Field(256, ge=1)
    engine_options: dict[str, Any] = Field(default_factory=dict, description="vllm: more vllm.LLM arguments, "
                                           "and 'env': variables set before vLLM is imported")
    resources: Resources | None = Field(None, description="disaggregated layout: the generators run as their own "
                                        "handle ('rollout') with these resources; unset: in the policy's workers")
    # vLLM only (engine: vllm); see docs/vllm.md.
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: GPUs per generator (tensor parallel)")
    gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="vllm: share of the GPU's total memory "
                                          "it may use (weights, activations, CUDA graphs, KV cache)")
    enforce_eager: bool = Field(False, description="vllm: no torch.compile and no CUDA graphs")
    sleep_level: Literal[0, 1, 2] = Field(1, description="vllm, co-located: what is freed while training runs: "
                                          "0 nothing, 1 KV cache (weights to CPU), 2 KV cache and weights")
    max_model_len: int | None = Field(None, ge=1, description="vllm: longest prompt + response (default: the model's)")
    max_num_seqs: int | None = Field(None, ge=1, description="vllm: sequences decoded at once (CUDA graph sizes)")

    @model_validator(mode="after")
    def _vllm_only(self):
        if self.engine == "hf":
            used = [f"{f}={getattr(self, f)!r}" for f in VLLM_ONLY
                    if f in self.model_fields_set and getattr(self, f) != type(self).model_fields[f].default]
            if used:
                raise ValueError(f"{', '.join(used)}: vLLM settings, but engine is 'hf'; remove them or set "
                                 f"engine: vllm")
        return self


VLLM_ONLY = ("tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "sleep_level", "max_model_len",
             "max_num_seqs")
"""``GenerateConfig`` fields only the vLLM engine reads (an error with engine 'hf')."""


class WeightSyncConfig(Strict):
    """How new policy weights reach the generate engine."""

    transport: Literal["auto", "in_process", "cpu", "cuda_ipc", "nccl"] = Field(
        "auto", description="auto: co-located -> in_process (HF) or cuda_ipc (vLLM on a GPU); "
        "split -> nccl on GPUs, cpu otherwise")
    bucket_mb: int = Field(256, ge=1, description="weights move in buckets of at most this size")
    verify: bool = Field(False, description="checksum every tensor on both sides; a mismatch stops the run")


class PolicyConfig(Strict):
    model: ModelPath
    train: TrainConfig = Field(default_factory=TrainConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    resources: Resources = Field(default_factory=Resources)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)


class CriticConfig(Strict):
    model: ModelPath | None = Field(None, description="default: the policy's model, with a new value head")
    train: TrainConfig = Field(default_factory=TrainConfig)
    resources: Resources = Field(default_factory=lambda: Resources(colocate_with="policy"))


class ReferenceConfig(Strict):
    model: ModelPath | None = Field(None, description="default: the policy's initial model")
    infer: InferConfig = Field(default_factory=InferConfig)
    resources: Resources = Field(default_factory=lambda: Resources(colocate_with="policy"))


class RewardConfig(Strict):
    """Where rewards come from: the env's rule, a reward model, or a Python function."""

    source: Literal["env", "model", "function"] = "env"
    model: ModelPath | None = None
    function: str | None = Field(None, description="import path 'pkg.mod:fn' of fn(prompts, responses) -> list[float]")
    infer: InferConfig = Field(default_factory=InferConfig)
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


class WarmupConfig(Strict):
    """An optional supervised warm-up of the policy on the env's examples before RL."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)


class CheckpointConfig(Strict):
    """Periodic checkpoints for exact resume (``xrlhf run ... --resume``)."""

    every: int = Field(0, ge=0, description="write a checkpoint every N RL steps (0: only at the end and on signals)")
    keep: int = Field(2, ge=1, description="keep the last K checkpoints")


class FaultToleranceConfig(Strict):
    """What happens when something goes wrong mid-run."""

    max_restarts: int = Field(0, ge=0, description="restart dead workers from the last checkpoint up to N times")
    max_bad_steps: int = Field(3, ge=1, description="abort after K consecutive steps with NaN/inf loss or rewards")
    reward_errors: Literal["fail", "zero"] = Field("fail", description="a reward function that raises: stop, or score 0")


class LoggingConfig(Strict):
    """Where metrics go besides ``metrics.jsonl``."""

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "xrlhf"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    report: bool = Field(True, description="write report.md and PNG plots at the end")


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
    algorithm: NamedSection = Field(default_factory=lambda: NamedSection(name="ppo"))
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _cross_checks(self):
        handles = {"policy", "critic", "reference", "reward"}
        for h in ("critic", "reference", "reward"):
            sec = getattr(self, h)
            if sec is not None and sec.resources.colocate_with not in (None, *handles - {h}):
                raise ValueError(f"{h}.resources.colocate_with: unknown handle "
                                 f"{sec.resources.colocate_with!r}; valid: {', '.join(sorted(handles - {h}))}")
        errors = layout_errors(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self


def layout_errors(cfg: XConfig) -> list[str]:
    """Checks of the generation layout (co-located or split) against the weight-sync transport."""
    p = cfg.policy
    g, t = p.generate, p.weight_sync.transport
    errors = []
    if g.resources is not None:  # split: a 'rollout' handle of generators
        where = "policy.generate.resources"
        if g.resources.colocate_with is not None:
            errors.append(f"{where}.colocate_with: the generators of the split layout have their own placement; "
                          f"remove it (leave {where} out for the co-located layout)")
        if t in ("in_process", "cuda_ipc"):
            errors.append(f"policy.weight_sync.transport: {t} needs the generator in the trainer's worker (co-located "
                          f"layout); with {where} set use nccl (GPUs), cpu or auto")
        gpus = g.resources.gpus_per_rank
    else:
        where = "policy.resources"
        if t == "nccl":
            errors.append("policy.weight_sync.transport: nccl broadcasts between GPUs, but the co-located layout puts "
                          "trainer and generator on one (NCCL cannot have two ranks on a GPU); use auto or cuda_ipc, "
                          "or set policy.generate.resources for the split layout")
        if g.engine == "vllm" and g.tensor_parallel_size > 1:
            errors.append("policy.generate.tensor_parallel_size: more than 1 needs the split layout "
                          "(policy.generate.resources with gpus_per_rank >= tensor_parallel_size)")
        gpus = p.resources.gpus_per_rank
    if g.engine == "vllm" and (gpus == 0 or g.tensor_parallel_size > 1 and gpus < g.tensor_parallel_size):
        errors.append(f"{where}.gpus_per_rank: engine vllm needs {g.tensor_parallel_size} GPU(s) per generator, "
                      f"got {gpus:g}")
    if t == "cuda_ipc" and p.resources.gpus_per_rank == 0:
        errors.append("policy.weight_sync.transport: cuda_ipc needs the policy on a GPU "
                      "(policy.resources.gpus_per_rank)")
    return errors
