"""docs/extending.md runs as written: its code blocks become a package ``mypkg`` and are used the
way the page says — an engine with its own validated option, an algorithm, an environment."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.algorithms.losses import SFTLoss
from xrlhf.data.batch import build_sequences
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec, build_engine
from xrlhf.engines.hf import HFTrainEngine
from xrlhf.envs import build_env
from xrlhf.utils.errors import UserError
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.utils.run_hooks import RunHooks

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


@pytest.fixture(scope="module")
def mypkg(tmp_path_factory):
    """The page's ``# mypkg/<file>.py`` blocks written out as an importable package."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    blocks = re.findall(r"```python\n(# mypkg/(\w+)\.py[^\n]*\n.*?)```", DOC.read_text(), re.S)
    assert {name for _, name in blocks} == {"engines", "algos", "envs", "rewards"}
    for code, name in blocks:
        (root / "mypkg" / f"{name}.py").write_text(code)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for m in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[m]


def config(model: str, **sections) -> dict:
    return {"env": {"name": "reasoning"}, "policy": {"model": model}, "reference": None,
            "algorithm": {"name": "grpo", "kl_coef": 0}, "trainer": {"samples_per_prompt": 2}, **sections}


def errors(data: dict) -> list[str]:
    with pytest.raises(UserError) as e:
        validate_dict(data)
    return e.value.messages


def test_engine_owns_a_validated_option_and_reports_the_same_loss(mypkg, tiny_model):
    train = {"engine": "mypkg.engines:SGDTrainEngine", "lr": 0.01, "momentum": 0.9}
    cfg = validate_dict(config(tiny_model, policy={"model": tiny_model, "train": train}))
    assert cfg.policy.train.momentum == 0.9
    assert errors(config(tiny_model, policy={"model": tiny_model, "train": {**train, "momentum": 2}})) == \
        ["policy.train.momentum: must be < 1, got 2"]
    msgs = errors(config(tiny_model, policy={"model": tiny_model, "train": {**train, "nesterov": True}}))
    assert len(msgs) == 1 and msgs[0].startswith("policy.train.nesterov: unknown key (valid: ") and "momentum" in msgs[0]

    batch = build_sequences([[1, 5, 6], [1, 7]], [[8, 9, 2], [10, 2]], pad_id=0)
    options = {"lr": 0.01, "micro_batch_size": 1}
    sgd = build_engine(train["engine"], EngineSpec(tiny_model, options={**options, "momentum": 0.9}), "train")
    before = {k: v.clone() for k, v in sgd.named_weights()}
    got = sgd.train_step(batch, SFTLoss())
    want = HFTrainEngine(EngineSpec(tiny_model, options=options)).train_step(batch, SFTLoss())
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)  # the template's loss, not the last micro-batch's
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert any(not torch.equal(before[k], v) for k, v in sgd.named_weights())


def test_algorithm_validates_its_options_and_updates(mypkg, tiny_model):
    algo = {"name": "mypkg.algos:BASELINE_PG", "baseline": 0.3, "kl_coef": 0, "mini_batch_size": 8}
    cfg = validate_dict(config(tiny_model, algorithm=algo, trainer={"prompts_per_step": 4, "samples_per_prompt": 2}))
    assert algorithm_options(cfg).baseline == 0.3
    assert errors(config(tiny_model, algorithm={**algo, "baselin": 0.3}))[0].startswith("algorithm.baselin: unknown key")

    spec = EngineSpec(tiny_model, options={"lr": 1e-3, "micro_batch_size": 8})
    policy = LocalHandle.of("policy", train=HFTrainEngine(spec),
                            generate=build_engine("hf", EngineSpec(tiny_model), "generate"))
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    trainer = build_trainer(cfg, algorithm_options(cfg), LocalHandles(policy), env,
                            load_tokenizer(tiny_model), reward=_env_reward(env), hooks=RunHooks())
    metrics = trainer.step()
    assert "policy/loss" in metrics and metrics["reward/mean"] >= 0


def _env_reward(env):
    def reward(prompts, responses, batch):
        scores = env.score(prompts, responses)
        return torch.tensor([s.reward for s in scores]), {}
    return reward


def test_env_options_are_validated_and_it_scores(mypkg, tiny_model):
    validate_dict(config(tiny_model, env={"name": "mypkg.envs:EchoEnv", "options": {"digits": 5}}))
    assert errors(config(tiny_model, env={"name": "mypkg.envs:EchoEnv", "options": {"digits": 11}})) == \
        ["env.options.digits: must be <= 10, got 11"]
    env = build_env("mypkg.envs:EchoEnv", {"digits": 5}, seed=0)
    prompts = env.train_prompts(0, 6)
    assert [p.text for p in prompts][:2] == ["say 0:", "say 1:"] and prompts[5].answer == "0"
    assert [s.reward for s in env.score(prompts[:2], ["0", " 7"])] == [1.0, 0.0]
