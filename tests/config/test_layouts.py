"""Config checks of the generation layout, the vLLM fields and the weight-sync transport."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
from pydantic import ValidationError

from xrlhf.validation import load_config, validate_dict
from xrlhf.config.loader import format_errors
from xrlhf.config.schema import XConfig
from xrlhf.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def errors(config: dict) -> list[str]:
    with pytest.raises(UserError) as e:
        validate_dict(config)
    return e.value.messages


def schema_errors(config: dict) -> list[str]:
    """The schema's own errors (validate_dict adds 'vllm not installed' on a machine without it)."""
    with pytest.raises(ValidationError) as e:
        XConfig.model_validate(config)
    return format_errors(e.value, XConfig)


def with_(config: dict, **paths) -> dict:
    out = copy.deepcopy(config)
    for path, value in paths.items():
        node = out
        *parents, last = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def test_vllm_fields_with_the_hf_engine_are_errors(base_config):
    msgs = errors(with_(base_config, policy__generate={"max_new_tokens": 4, "sleep_level": 2,
                                                      "gpu_memory_utilization": 0.5}))
    assert msgs == [f"policy.generate.{k}: an option of engine 'vllm', but policy.generate.engine is 'hf'; remove it "
                    f"or set policy.generate.engine: vllm" for k in ("gpu_memory_utilization", "sleep_level")]
    # even at its default value: a backend's option in another backend's section is a mistake
    assert len(errors(with_(base_config, policy__generate={"max_new_tokens": 4, "sleep_level": 1}))) == 1


def test_vllm_needs_a_gpu_and_tensor_parallel_needs_the_split_layout(base_config):
    """The vLLM engine's own ``placement_errors``, asked by validation (no vLLM needed to ask)."""
    cfg = with_(base_config, policy__generate={"engine": "vllm", "tensor_parallel_size": 2})
    msgs = errors(cfg)
    assert any(m.startswith("policy.generate.tensor_parallel_size: more than 1 needs the split layout") for m in msgs)
    assert any(m.startswith("policy.resources.gpus_per_rank: engine vllm needs 2 GPU(s)") for m in msgs)
    cfg = with_(base_config, policy__generate={"engine": "vllm"}, policy__resources={"ranks": 2, "gpus_per_rank": 0.5})
    msgs = errors(cfg) if not HAS_VLLM else []  # a fractional GPU is enough co-located
    assert all("needs the vllm package" in m for m in msgs), msgs


def test_transports_must_fit_the_layout(base_config):
    split = {"engine": "hf", "resources": {"ranks": 2, "cpus_per_rank": 0.5}}
    msgs = errors(with_(base_config, policy__generate=split, policy__weight_sync={"transport": "in_process"}))
    assert any(m.startswith("policy.weight_sync.transport: in_process hands tensors over inside one process")
               for m in msgs), msgs
    msgs = errors(with_(base_config, policy__generate=split, policy__weight_sync={"transport": "cuda_ipc"}))
    assert any(m.startswith("policy.weight_sync.transport: cuda_ipc needs trainer and generator on one GPU")
               for m in msgs), msgs
    gpu = {"ranks": 1, "gpus_per_rank": 1}
    msgs = errors(with_(base_config, policy__resources=gpu, policy__weight_sync={"transport": "nccl"}))
    assert any(m.startswith("policy.weight_sync.transport: nccl broadcasts between devices") for m in msgs), msgs
    for t in ("auto", "cpu", "nccl", "disk"):  # nccl runs over gloo on CPU
        validate_dict(with_(base_config, policy__generate=split, policy__weight_sync={"transport": t}))
        validate_dict(with_(base_config, policy__weight_sync={"transport": t}))  # co-located on CPU
    msgs = errors(with_(base_config, policy__generate={"resources": {"ranks": 3, "colocate_with": "critic"}}))
    assert any(m.startswith("policy.generate.resources.colocate_with:") for m in msgs)
    msgs = errors(with_(base_config, policy__weight_sync={"transport": "cuda_ipc"}))
    assert any(m.startswith("policy.weight_sync.transport: cuda_ipc needs trainer and generator on one GPU")
               for m in msgs), msgs


def test_a_transport_owns_its_options(base_config):
    validate_dict(with_(base_config, policy__weight_sync={"transport": "disk", "directory": "/somewhere"}))
    msgs = errors(with_(base_config, policy__weight_sync={"transport": "cpu", "directory": "/somewhere"}))
    assert msgs == ["policy.weight_sync.directory: Extra inputs are not permitted (transport 'cpu'; its options: "
                    "none)"]
    msgs = errors(with_(base_config, policy__weight_sync={"transport": "disk", "packed": True}))
    assert msgs == ["policy.weight_sync.packed: Extra inputs are not permitted (transport 'disk'; its options: "
                    "directory)"]


def load_gpu_config(name: str, overrides: list[str]):
    """``configs/gpu/<name>.yaml`` loaded; ``None`` without vLLM, where the config is valid but for
    the missing package, which is then the one error."""
    path = ROOT / "configs" / "gpu" / f"{name}.yaml"
    if HAS_VLLM:
        return load_config(path, overrides)
    with pytest.raises(UserError) as e:
        load_config(path, overrides)
    assert e.value.messages == ["policy.generate.engine: 'vllm' needs the vllm package; install it with "
                                "pip install -e '.[gpu]'"]
    return None


@pytest.mark.parametrize("name", ["ppo_vllm_colocate", "ppo_vllm_split"])
def test_gpu_configs_validate(name, tiny_model):
    cfg = load_gpu_config(name, [f"policy.model={tiny_model}"])
    if cfg is None:
        return
    g = cfg.policy.generate
    assert g.engine == "vllm" and cfg.policy.train.dtype == "bfloat16" and cfg.policy.weight_sync.verify
    assert (g.resources is None) == (name == "ppo_vllm_colocate")


def test_colocated_handles_run_on_their_anchors_gpu(base_config):
    """A handle co-located with the policy gets a share of the policy's GPU, so its engines are
    built on CUDA even though its own ``gpus_per_rank`` is 0 (the first GPU session trained the
    critic of ``configs/gpu/ppo_vllm_colocate.yaml`` on the CPU: 130 s a step)."""
    from xrlhf.topology import handle_specs

    cfg = XConfig.model_validate(with_(base_config, policy__resources={"ranks": 1, "gpus_per_rank": 1},
                                       critic={}, reference={}))
    devices = {s.name: {role: e[1].device for role, e in s.engines.items()}
               for s in handle_specs(cfg, "model", {})}
    assert devices == {"policy": {"train": "cuda"}, "rollout": {"generate": "cuda"}, "critic": {"train": "cuda"},
                       "reference": {"infer": "cuda"}}
    cfg = XConfig.model_validate(with_(base_config, critic={"resources": {"ranks": 1}}, reference={}))
    devices = {s.name: [e[1].device for e in s.engines.values()] for s in handle_specs(cfg, "model", {})}
    assert devices == {"policy": ["cpu"], "rollout": ["cpu"], "critic": ["cpu"], "reference": ["cpu"]}


def test_the_generator_is_a_handle_of_its_own_in_every_layout(base_config):
    """Co-located: one generator per policy rank in the policy's bundles, weights by cuda_ipc on a
    GPU (cpu otherwise); split: its own resources, nccl between GPUs. Only placement and transport differ."""
    from xrlhf.topology import topology

    for res, gen, want in (({"ranks": 2, "cpus_per_rank": 1}, None, ("policy", 2, "cpu", True)),
                           ({"ranks": 1, "gpus_per_rank": 1}, None, ("policy", 1, "cuda_ipc", True)),
                           ({"ranks": 1, "gpus_per_rank": 1}, {"ranks": 2, "gpus_per_rank": 1}, (None, 2, "nccl", False)),
                           ({"ranks": 1}, {"ranks": 1}, (None, 1, "cpu", False))):
        over = {"policy__resources": res} | ({"policy__generate": {"resources": gen}} if gen else {})
        t = topology(XConfig.model_validate(with_(base_config, **over)), "model")
        rollout = t.spec("rollout")
        assert "generate" not in t.spec("policy").engines and list(rollout.engines) == ["generate"]
        got = (rollout.resources.colocate_with, rollout.resources.ranks, t.weight_sync.transport, t.weight_sync.colocated)
        assert got == want, (res, gen)


def test_unknown_transport_lists_the_registered_ones(base_config):
    msgs = errors(with_(base_config, policy__weight_sync={"transport": "carrier_pigeon"}))
    assert msgs == ["policy.weight_sync.transport: unknown weight-sync transport 'carrier_pigeon'; valid: cpu, "
                    "cuda_ipc, disk, in_process, nccl (or an import path 'pkg.module:Name') (or auto)"]


def test_handles_that_train_on_one_gpu_share_its_memory_for_their_budgets(base_config):
    """PPO's policy and critic train at once on the co-located GPU: each derived token budget
    plans for half of the free memory (``engines.budget``); a critic on its own GPU for all of it."""
    from xrlhf.topology import handle_specs

    gpu = {"policy__resources": {"ranks": 1, "gpus_per_rank": 1}, "reference": {}}
    specs = {s.name: s for s in handle_specs(XConfig.model_validate(with_(base_config, critic={}, **gpu)), "m", {})}
    assert specs["policy"].engines["train"][1].memory_share == specs["critic"].engines["train"][1].memory_share == 0.5
    assert specs["reference"].engines["infer"][1].memory_share == 1.0
    own = with_(base_config, critic={"resources": {"ranks": 1, "gpus_per_rank": 1}}, **gpu)
    specs = {s.name: s for s in handle_specs(XConfig.model_validate(own), "m", {})}
    assert specs["policy"].engines["train"][1].memory_share == specs["critic"].engines["train"][1].memory_share == 1.0


def test_the_distill_gpu_config_validates(tiny_model):
    """configs/gpu/distill_vllm.yaml (its teacher: the tiny model here; the same char tokenizer)."""
    cfg = load_gpu_config("distill_vllm", [f"policy.model={tiny_model}", f"teacher.model={tiny_model}"])
    if cfg is None:
        return
    assert cfg.algorithm.name == "distill" and cfg.policy.generate.engine == "vllm"
    assert cfg.policy.generate.dtype == cfg.policy.train.dtype == "float32"
