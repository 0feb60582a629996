"""Every registered algorithm's policy weights after 2 in-process steps, pinned (sha256 of
``named_weights``): a refactor of the trainers (docs/design/composition.md, stages 4-7) keeps the
numbers, the RNG draw order included. A pin moves only with a change that means to move it."""

import hashlib
from pathlib import Path

import pytest
import torch

from xrlhf.algorithms import ALGORITHMS
from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.algorithms.rewards import build_reward
from xrlhf.data.datasets import write_jsonl
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine, HFTrainEngine
from xrlhf.envs import build_env
from xrlhf.models.tiny import build_model
from xrlhf.utils.run_hooks import RunHooks
from xrlhf.validation import algorithm_options, validate_dict

PINS = {
    ("2.13", "AVX2", "AuthenticAMD"): {
        "critic_free": "06d075bfc892e31e",
        "distill": "1d36f506545a1317",
        "distill+topk+offline": "3e32ab8f97242253",
        "dpo": "fa5c416de6e95d51",
        "dr_grpo": "f93b9fadfd7af7c3",
        "grpo": "a4130d0d546454e2",
        "grpo+kl+epochs": "3fc66f96b7726e1f",
        "kto": "ab415000078581f2",
        "kto_online": "4fb6af40803a4c32",
        "ppo": "c87dfbe7ce3e09c2",
        "reinforce_pp": "d4192ef72bbc9108",
        "reinforce_pp_baseline": "6088f0a79fcaf4f9",
        "rloo": "06d075bfc892e31e",
        "rm": "19fdad77be43d815",
    },
    ("2.13", "AVX512", "AuthenticAMD"): {
        "critic_free": "c6cc2600a196175a",
        "distill": "c4caa30be8920f38",
        "distill+topk+offline": "2df4ccdd8063d27b",
        "dpo": "5483b29299461676",
        "dr_grpo": "460d37544e56e53e",
        "grpo": "1d88eaf2fa5f82cf",
        "grpo+kl+epochs": "9bc52f117e8eb49e",
        "kto": "54a744d283f6d216",
        "kto_online": "add94d0cb3482d42",
        "ppo": "1dbe464d40fb2d3c",
        "reinforce_pp": "d62e107a69603a27",
        "reinforce_pp_baseline": "05364008de158063",
        "rloo": "c6cc2600a196175a",
        "rm": "8d88c3ed5551913f",
    },
}
"""(torch's minor release, its CPU kernels, the CPU's vendor) -> case (``ALGORITHM``) -> the first 16 hex
digits of the sha256 of its policy weights after 2 steps. Other kernels round differently (and a
sampled token can flip), so each machine class has its own pins, recorded from the same code; on a
class without pins the test skips: pin it there before a refactor, from the code before it."""


def machine() -> tuple[str, str, str]:
    vendor = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("vendor_id")), "?") if Path("/proc/cpuinfo").is_file() else "?"
    return ".".join(torch.__version__.split(".")[:2]), torch.backends.cpu.get_cpu_capability(), vendor


ONLINE = {"mini_batch_size": 4}
ALGORITHM = {
    "ppo": ONLINE, "grpo": ONLINE, "dr_grpo": ONLINE, "rloo": ONLINE, "reinforce_pp": ONLINE,
    "reinforce_pp_baseline": ONLINE, "critic_free": {**ONLINE, "advantage_estimator": "rloo"},
    "distill": {**ONLINE, "task_reward_weight": 0.5}, "kto_online": ONLINE,
    "dpo": {"batch_size": 4}, "kto": {"batch_size": 4}, "rm": {"batch_size": 4},
    "grpo+kl+epochs": {**ONLINE, "kl_coef": 0.1, "ppo_epochs": 2, "tis_cap": 2.0},
    "distill+topk+offline": {**ONLINE, "topk_coef": 1.0, "offline_fraction": 0.2},
}
"""Case -> algorithm options; a case ``name+...`` runs algorithm ``name``."""
TOPK = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("numbers")
    build_model(root / "model", seed=0)
    build_model(root / "teacher", seed=1)
    pairs = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 3)} for a in range(8)]
    write_jsonl(pairs, root / "pairs.jsonl")
    write_jsonl([{"prompt": f"{a}+1=", "completion": str(a + 1), "label": a % 2 == 0} for a in range(8)],
                root / "kto.jsonl")
    write_jsonl([{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(8)], root / "completions.jsonl")
    return root


def make_trainer(root, case: str):
    model, teacher = str(root / "model"), str(root / "teacher")
    name = case.split("+")[0]
    algorithm = {"name": name, **ALGORITHM[case]}
    extra: dict = {}
    if "offline_fraction" in algorithm:
        algorithm["offline_dataset"] = str(root / "completions.jsonl")
    if name in ("dpo", "rm"):
        algorithm["dataset"] = str(root / "pairs.jsonl")
    if name == "kto":
        algorithm["dataset"] = str(root / "kto.jsonl")
    if name == "ppo":
        extra["critic"] = {}
    if name == "distill":
        topk = {"infer": {"topk_logprobs": TOPK}} if "topk_coef" in algorithm else {}
        extra.update(teacher={"model": teacher, "evaluate": False, **topk}, reference=None)
    if name == "rm":
        extra["reference"] = None
        algorithm["eval_dataset"] = str(root / "pairs.jsonl")
    if name not in ("dpo", "kto", "rm"):  # rewards that differ within a group: every estimator moves the policy
        extra["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:length_reward"}
    cfg = validate_dict({"env": {"name": "reasoning", "options": {"eval_size": 8}},
                         "policy": {"model": model, "train": {"lr": 1e-3}, "generate": {"max_new_tokens": 6}},
                         "algorithm": algorithm, "trainer": {"prompts_per_step": 4, "samples_per_prompt": 2},
                         **extra})
    cls = ALGORITHMS.get(name)
    head = cls.policy_head
    spec = EngineSpec(model_path=model, head=head, options={"lr": 1e-3, "micro_batch_size": 8}, seed=0)
    gen = (HFGenerateEngine(EngineSpec(model, options={"micro_batch_size": 32}, seed=0))
           if cls.uses_generation else None)
    other = {}
    if cfg.reference is not None:
        other["reference"] = LocalHandle.of("reference", infer=HFInferEngine(EngineSpec(model_path=model, seed=0)))
    if cfg.critic is not None:
        cspec = EngineSpec(model_path=model, head="value", options={"lr": 1e-3, "micro_batch_size": 8}, seed=0)
        other["critic"] = LocalHandle.of("critic", train=HFTrainEngine(cspec))
    if cfg.teacher is not None:
        topk = {"topk_logprobs": TOPK} if "topk_coef" in algorithm else {}
        scorer = HFInferEngine(EngineSpec(model_path=teacher, seed=0, options=topk))
        other["teacher"] = LocalHandle.of("teacher", infer=scorer)
    handles = LocalHandles(LocalHandle.of("policy", train=HFTrainEngine(spec), generate=gen), **other)
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    reward = build_reward(cfg, env, handles) if cls.uses_generation else None
    return build_trainer(cfg, algorithm_options(cfg), handles, env, load_tokenizer(model), reward=reward,
                         hooks=RunHooks(log=lambda m: None))


def digest(handle) -> str:
    h = hashlib.sha256()
    for name, t in handle.hosts[0].train.named_weights():
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("case", sorted(ALGORITHM))
def test_two_steps_give_the_pinned_weights(root, case):
    pins = PINS.get(machine())
    if pins is None:
        pytest.skip(f"pins recorded with torch, CPU kernels and vendor {sorted(PINS)}; here {machine()}")
    torch.manual_seed(0)
    trainer = make_trainer(root, case)
    try:
        for _ in range(2):
            trainer.step()
        assert digest(trainer.policy) == pins.get(case), case
    finally:
        if getattr(trainer, "producer", None) is not None:
            trainer.producer.stop(timeout=5.0)


def test_every_registered_algorithm_is_pinned():
    assert sorted(ALGORITHMS.names()) == sorted(c for c in ALGORITHM if "+" not in c)
    assert all(sorted(pins) == sorted(ALGORITHM) for pins in PINS.values())
