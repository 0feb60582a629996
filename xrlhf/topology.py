"""The run's topology, decided once by the shell from the validated config.

Which handles exist (is there a reference, or is it the policy's own base? a critic? a reward
model?), what engines each runs, where its ranks go, and how the policy's weights reach the
generators: the coordinator builds exactly this ``Topology`` and reads no config. The generators
are always a handle of their own, ``rollout``: co-located (the default) they share the policy's
bundles, one per policy rank (a share of its GPU); with ``policy.generate.resources`` set they
run on devices of their own (the split layout). The two layouts differ only in that placement
and in the transport ``auto`` picks (``weight_sync.choose_transport``).
"""

from __future__ import annotations

from pydantic import BaseModel

from xrlhf.config.schema import Resources, XConfig
from xrlhf.coordinator.spec import HandleSpec, Topology, WeightSyncPlan, anchor_of
from xrlhf.engines.base import EngineSpec, engine_class, engine_options
from xrlhf.weight_sync import choose_transport


def policy_adapter(cfg: XConfig) -> BaseModel | None:
    """The LoRA adapter the policy trains (its train engine's ``adapter_options``), or ``None``."""
    train = cfg.policy.train
    return engine_class(train.engine, "train").adapter_options(
        engine_options(train.engine, "train", train.engine_fields(), "policy.train"))


def reference_is_policy_base(cfg: XConfig) -> bool:
    """Whether the reference is the policy's own base with its LoRA adapters off (no model of its
    own): ``reference.from_policy_base``, or by default when the policy trains LoRA adapters and
    ``reference.model`` is unset (the reference is then the policy's start model anyway)."""
    r = cfg.reference
    if r is None:
        return False
    if r.from_policy_base is not None:
        return r.from_policy_base
    return r.model is None and policy_adapter(cfg) is not None


def generator_resources(cfg: XConfig) -> Resources:
    """Where the ``rollout`` handle runs: ``policy.generate.resources``, or by default one
    generator per policy rank in the policy's bundles."""
    p = cfg.policy
    if p.generate.resources is not None:
        return p.generate.resources
    return Resources(ranks=p.resources.ranks, cpus_per_rank=p.resources.cpus_per_rank,
                     gpus_per_rank=p.resources.gpus_per_rank, colocate_with="policy")


def placements(cfg: XConfig, generate: bool = True) -> dict[str, Resources]:
    """Every handle's resources, by name (the reference only when it has a model of its own)."""
    placed = {"policy": cfg.policy.resources}
    if generate:
        placed["rollout"] = generator_resources(cfg)
    from_base = reference_is_policy_base(cfg)
    placed.update({h: getattr(cfg, h).resources for h in ("critic", "reference")
                   if getattr(cfg, h) is not None and not (h == "reference" and from_base)})
    if cfg.reward.source == "model":
        placed["reward"] = cfg.reward.resources
    if cfg.teacher is not None:
        placed["teacher"] = cfg.teacher.resources
    return placed


def colocated(cfg: XConfig) -> bool:
    """Whether the generators share the policy's bundles (the co-located layout)."""
    placed = placements(cfg)
    return anchor_of("rollout", placed) == anchor_of("policy", placed)


def on_gpu(placed: dict[str, Resources], name: str) -> bool:
    """Whether handle ``name`` runs on a GPU: a co-located handle runs where its anchor's bundle
    is (a share of its GPU), whatever its own ``gpus_per_rank`` says."""
    return placed[anchor_of(name, placed)].gpus_per_rank > 0


def weight_sync_plan(cfg: XConfig) -> WeightSyncPlan:
    """The transport (``auto`` resolved here, the one place) and its options."""
    ws, placed = cfg.policy.weight_sync, placements(cfg)
    together = colocated(cfg)
    name = choose_transport(ws.transport, together, on_gpu(placed, "policy") and on_gpu(placed, "rollout"))
    options = {"bucket_bytes": ws.bucket_mb << 20, "verify": ws.verify, "dtype": cfg.policy.generate.dtype,
               **{k: v for k, v in ws.transport_options().items() if v is not None}}
    return WeightSyncPlan(name, options, together, ws.verify)


def train_shares(placed: dict[str, Resources], trained: list[str]) -> dict[str, float]:
    """The share of its GPU's free memory each trained handle's derived token budget may plan
    for: 1 / the trained handles of its placement group (PPO's policy and critic train at once
    on one co-located GPU; ``engines.budget``)."""
    groups = {h: anchor_of(h, placed) for h in trained}
    return {h: 1.0 / sum(a == g for a in groups.values()) for h, g in groups.items()}


def handle_specs(cfg: XConfig, policy_model: str, total_train_steps: dict[str, int],
                 policy_head: str = "causal_lm", generate: bool = True, cache_dir: str | None = None
                 ) -> list[HandleSpec]:
    """The handles a run needs (``policy_model``: the RL start point; ``policy_head`` /
    ``generate``: the trained model's head and whether anything generates: a reward model being
    trained has a ``"score"`` head and no generator; ``cache_dir``: the run's directory for caches
    that outlive a worker, such as compiled kernels)."""
    placed = placements(cfg, generate)
    shares = train_shares(placed, [h for h in ("policy", "critic") if h in placed])

    def spec(model: str, head: str, name: str, section, role: str, path: str, temperature: float = 1.0,
             total_steps: int = 0, adapter=None) -> tuple[str, EngineSpec]:
        options = engine_options(section.engine, role, section.engine_fields(), path)  # validated before
        return section.engine, EngineSpec(model_path=model, head=head, device="cuda" if on_gpu(placed, name) else "cpu",
                                          options=options, seed=cfg.seed, temperature=temperature,
                                          total_steps=total_steps, adapter=adapter, cache_dir=cache_dir,
                                          memory_share=shares.get(name, 1.0) if role == "train" else 1.0)

    p = cfg.policy
    temp = p.generate.temperature or 1.0
    out = [HandleSpec("policy", {"train": spec(policy_model, policy_head, "policy", p.train, "train", "policy.train",
                                               temp, total_train_steps.get("policy", 0))}, p.resources)]
    if generate:
        adapter = policy_adapter(cfg)  # a LoRA adapter the syncs carry as such, not merged
        adapter = adapter if adapter is not None and adapter.sync == "adapter" else None
        out.append(HandleSpec("rollout", {"generate": spec(policy_model, "causal_lm", "rollout", p.generate, "generate",
                                                           "policy.generate", temp, adapter=adapter)},
                              placed["rollout"]))
    if "critic" in placed:
        c = cfg.critic
        out.append(HandleSpec("critic", {"train": spec(c.model or policy_model, "value", "critic", c.train, "train",
                                                       "critic.train", total_steps=total_train_steps.get("critic", 0))},
                              c.resources))
    if "reference" in placed:
        r = cfg.reference
        out.append(HandleSpec("reference", {"infer": spec(r.model or policy_model, "causal_lm", "reference", r.infer,
                                                          "infer", "reference.infer", temp)}, r.resources))
    if "reward" in placed:
        w = cfg.reward
        out.append(HandleSpec("reward", {"infer": spec(w.model, "score", "reward", w.infer, "infer", "reward.infer")},
                              w.resources))
    if "teacher" in placed:
        out.append(teacher_spec(cfg, spec))
    return out


def teacher_spec(cfg: XConfig, spec) -> HandleSpec:
    """The teacher: an infer engine scoring the student's tokens at the sampling temperature (the
    student's logprobs are of softmax(logits / T) too), and with ``teacher.evaluate`` an ``hf``
    generate engine for its one greedy evaluation (it receives no weights)."""
    t, g = cfg.teacher, cfg.policy.generate
    engines = {"infer": spec(t.model, "causal_lm", "teacher", t.infer, "infer", "teacher.infer",
                             g.temperature or 1.0)}
    if t.evaluate:
        from xrlhf.config.schema import GenerateConfig

        section = GenerateConfig(dtype=t.infer.dtype, max_new_tokens=g.max_new_tokens,
                                 stop_token_ids=list(g.stop_token_ids))
        engines["generate"] = spec(t.model, "causal_lm", "teacher", section, "generate", "teacher")
    return HandleSpec("teacher", engines, t.resources)


def topology(cfg: XConfig, policy_model: str, total_train_steps: dict[str, int] | None = None,
             policy_head: str = "causal_lm", generate: bool = True, concurrent_generate: int = 0,
             cache_dir: str | None = None) -> Topology:
    """The run's topology (see the module docstring); ``concurrent_generate``: ``generate`` calls an
    episode env may have running at once on one generator; ``cache_dir``: see ``handle_specs``."""
    return Topology(handles=handle_specs(cfg, policy_model, total_train_steps or {}, policy_head, generate,
                                         cache_dir),
                    weight_sync=weight_sync_plan(cfg) if generate else None,
                    reference_from_policy=reference_is_policy_base(cfg),
                    max_staleness=cfg.rollout.max_staleness, concurrent_generate=concurrent_generate,
                    ray=cfg.ray, fault_tolerance=cfg.fault_tolerance)
