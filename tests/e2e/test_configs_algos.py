"""Short end-to-end runs of the algorithm configs (DPO, KTO offline / online, GRPO, reward model
then PPO on the Q&A env with it), and of a custom env + custom estimator + reward function
registered in this module. Each run is the shipped YAML with a few overrides: 2 steps, a tiny
warm-up, small data generated into a temporary directory. One Ray serves all of them. DPO and
offline KTO run on the shipped two policy ranks (pairs and batches split between ranks); the
others on one (``ONE_RANK``: each rank is a process of its own, with its generator, ~7 CPU-s to
start on the 2-core box)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xrlhf.algorithms.estimators import ADVANTAGE_ESTIMATORS
from xrlhf.validation import load_config
from xrlhf.data.datasets import write_jsonl
from xrlhf.envs import Env, Prompt, Score, register_env
from xrlhf.envs.reasoning import ReasoningOptions
from xrlhf.envs.synthetic import make_rows, source_prompts
from xrlhf.models.tiny import build_model

REPO = Path(__file__).resolve().parents[2]
SHORT = ["trainer.steps=2", "trainer.eval_every=1", "trainer.eval_size=16", "warmup.steps=4", "warmup.batch_size=16",
         "policy.train.micro_batch_size=16"]
ONE_RANK = "policy.resources.ranks=1"
ESTIMATOR_CALLS: list[int] = []


# -- a user's env, estimator and reward function, registered from a test module ------------------
@register_env("test_copy")
class CopyEnv(Env):
    """``copy ab:`` -> ``ab``: a rule reward of 1 for an exact copy."""

    def _prompt(self, split: str, i: int) -> Prompt:
        word = "".join("abc"[(i * 7 + k + (split == "eval")) % 3] for k in range(2))
        return Prompt(text=f"copy {word}:", answer=word, task="copy", index=i)

    def train_prompts(self, start: int, n: int) -> list[Prompt]:
        return [self._prompt("train", i) for i in range(start, start + n)]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt("eval", i) for i in range(8)]

    def score(self, prompts: list[Prompt], responses: list[str]) -> list[Score]:
        return [Score(float(r.strip() == p.answer), r.strip() == p.answer) for p, r in zip(prompts, responses)]


@ADVANTAGE_ESTIMATORS.register("test_e2e_centered")
def centered_estimator(scores, mask, group_ids, *, gamma=1.0, token_rewards=None, eps=1e-6):
    """A user's estimator: the batch-mean-centred score on every token."""
    ESTIMATOR_CALLS.append(len(scores))
    return (scores - scores.mean()).unsqueeze(1) * mask


def short_answer_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """A plain reward function named by import path: 1 for a response of 2 characters or fewer."""
    return [float(len(r.strip()) <= 2) for r in responses]


# -- shared assets ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("algo_e2e")
    opts = ReasoningOptions()
    files = {"model": build_model(d / "tiny-char")}
    for name, kind, rows, split in (("preferences", "preferences", 64, "train"), ("pairs_eval", "preferences", 32, "eval"),
                                    ("kto", "kto", 64, "train"), ("qa", "qa", 64, "train"), ("qa_eval", "qa", 16, "eval")):
        files[name] = write_jsonl(make_rows(kind, source_prompts(opts, rows, split, seed=1), opts, seed=1),
                                  d / f"{name}.jsonl")
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def ray_session(assets):
    """One local Ray for every run of this module (each run's Coordinator leaves it running)."""
    import ray

    from tests.conftest import start_ray

    start_ray(load_config(REPO / "configs" / "grpo.yaml", [f"policy.model={assets['model']}"]).ray)
    yield
    ray.shutdown()


def run_config(name: str, out: Path, overrides: list[str]) -> dict:
    from xrlhf.runner import run

    cfg = load_config(REPO / "configs" / f"{name}.yaml", SHORT + overrides)
    summary = run(cfg, out)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["steps"] == 2
    for key in ("eval_reward_initial", "eval_reward_final"):
        assert isinstance(summary[key], float)
    assert (out / "final" / "config.json").is_file()
    return summary


def step_metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step") and "time/step_s" in r]


# -- the configs ------------------------------------------------------------------------------------
def test_dpo(assets, ray_session, tmp_path):
    run_config("dpo", tmp_path, [f"policy.model={assets['model']}", f"algorithm.dataset={assets['preferences']}",
                                 "algorithm.batch_size=8"])
    steps = step_metrics(tmp_path)
    assert len(steps) == 2 and all("dpo/reward_accuracy" in m for m in steps)
    assert abs(steps[0]["dpo/reward_margin"]) < 1e-4  # policy == reference at step 1: no margin yet
    assert steps[0]["policy/loss"] > 0.693  # ln 2 from DPO, plus the NLL of the chosen answers (nll_weight 1)


def test_kto_offline(assets, ray_session, tmp_path):
    run_config("kto_offline", tmp_path, [f"policy.model={assets['model']}", f"algorithm.dataset={assets['kto']}",
                                         "algorithm.batch_size=8"])
    steps = step_metrics(tmp_path)
    assert all("kto/kl" in m and "kto/desirable_fraction" in m for m in steps)
    # step 1: r = z = 0, so each row costs its weight times 1 - sigmoid(0) = 0.5 (w_d 1.33, w_u 1)
    assert steps[0]["kto/kl"] == pytest.approx(0.0, abs=1e-5)
    assert 0.5 - 1e-4 <= steps[0]["policy/loss"] <= 0.665 + 1e-4


def test_kto_online(assets, ray_session, tmp_path):
    run_config("kto_online", tmp_path, [ONE_RANK, f"policy.model={assets['model']}", "trainer.prompts_per_step=8",
                                        "algorithm.mini_batch_size=8"])
    steps = step_metrics(tmp_path)
    assert all("kto/desirable_fraction" in m and "reward/mean" in m for m in steps)


def test_grpo(assets, ray_session, tmp_path):
    run_config("grpo", tmp_path, [ONE_RANK, f"policy.model={assets['model']}", "trainer.prompts_per_step=4",
                                  "trainer.samples_per_prompt=4", "algorithm.mini_batch_size=8"])
    steps = step_metrics(tmp_path)
    assert all("advantages/abs_mean" in m and "policy/clip_frac" in m for m in steps)


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_reward_model_then_ppo_on_qa_with_it(assets, ray_session, tmp_path):
    rm = run_config("rm", tmp_path / "rm", [ONE_RANK, f"policy.model={assets['model']}", f"algorithm.dataset={assets['preferences']}",
                                            f"algorithm.eval_dataset={assets['pairs_eval']}", "algorithm.batch_size=8"])
    assert 0.0 <= rm["eval_accuracy"] <= 1.0 and rm["eval_pairs"] == 32
    config = json.loads((tmp_path / "rm" / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]

    qa = run_config("qa_ppo", tmp_path / "qa", [
        ONE_RANK, f"policy.model={assets['model']}", f"env.options.dataset={assets['qa']}",
        f"env.options.eval_dataset={assets['qa_eval']}", f"reward.model={rm['final_checkpoint']}",
        "trainer.prompts_per_step=16", "algorithm.mini_batch_size=16"])
    assert "eval/exact_match" in qa["eval_final"]
    steps = step_metrics(tmp_path / "qa")
    assert all("reward/mean" in m and "critic/loss" in m for m in steps)


def test_custom_env_estimator_and_reward_function(assets, ray_session, tmp_path):
    ESTIMATOR_CALLS.clear()
    summary = run_config("grpo", tmp_path, [
        ONE_RANK, f"policy.model={assets['model']}", "env.name=test_copy", "env.options={}", "algorithm.name=critic_free",
        "algorithm.advantage_estimator=test_e2e_centered", "reward.source=function",
        f"reward.function={__name__}:short_answer_reward", "trainer.prompts_per_step=4",
        "trainer.samples_per_prompt=2", "algorithm.mini_batch_size=8"])
    assert ESTIMATOR_CALLS == [8, 8]  # the registered estimator ran once per step
    rewards = [m["reward/mean"] for m in step_metrics(tmp_path)]
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert "eval/accuracy" in summary["eval_final"]  # evaluated by the env's own rule

