"""Config checks of the new algorithms: each problem is one line named by its YAML path,
all reported together, before anything starts."""

import pytest

from xrlhf.algorithms import ALGORITHMS
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.data.datasets import write_jsonl
from xrlhf.utils.errors import UserError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from xrlhf.models.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return str(write_jsonl([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}], tmp_path_factory.mktemp("d") / "p.jsonl"))


def errors(data: dict) -> list[str]:
    with pytest.raises(UserError) as e:
        validate_dict(data)
    return e.value.messages


def base(model, algorithm, **sections):
    return {"env": {"name": "reasoning"}, "policy": {"model": model}, "algorithm": algorithm, **sections}


def test_every_algorithm_is_registered():
    for name in ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "critic_free",
                 "kto", "kto_online", "dpo", "rm", "distill"):
        assert name in ALGORITHMS


def test_critic_free_estimator_defaults_to_the_algorithm_name(model):
    cfg = validate_dict(base(model, {"name": "rloo", "mini_batch_size": 8},
                             trainer={"prompts_per_step": 4, "samples_per_prompt": 4}))
    assert algorithm_options(cfg).advantage_estimator is None
    lines = errors(base(model, {"name": "critic_free", "mini_batch_size": 8},
                        trainer={"prompts_per_step": 4, "samples_per_prompt": 4}))
    assert lines == [lines[0]] and lines[0].startswith("algorithm.advantage_estimator: unknown advantage "
                                                       "estimator 'critic_free'; valid: dr_grpo, grpo")


def test_critic_free_checks_are_reported_together(model):
    lines = errors(base(model, {"name": "grpo", "mini_batch_size": 3, "kl_coef": 0.1, "kl_in_reward": True},
                        reference=None, trainer={"prompts_per_step": 4, "samples_per_prompt": 1}))
    assert any(x.startswith("algorithm.mini_batch_size: 3 must divide the rollout batch") for x in lines), lines
    assert any(x.startswith("trainer.samples_per_prompt: estimator 'grpo' compares") for x in lines), lines
    assert any(x.startswith("algorithm.kl_in_reward: estimator 'grpo' uses outcome scores only") for x in lines)
    assert any(x.startswith("reference: algorithm.kl_coef > 0 needs a reference section") for x in lines), lines
    assert any(x.startswith("algorithm.kl_estimator") for x in errors(base(model, {"name": "grpo", "kl_estimator": "k9"})))


def test_pair_algorithms_need_even_micro_batches_and_whole_shards(model, pairs):
    policy = {"model": model, "train": {"micro_batch_size": 5}, "resources": {"ranks": 2}}
    lines = errors({"env": {"name": "reasoning"}, "policy": policy,
                    "algorithm": {"name": "dpo", "dataset": pairs, "batch_size": 3}})
    assert "policy.train.micro_batch_size: 5 must be even: a micro-batch holds whole (chosen, rejected) pairs" in lines
    assert any(x.startswith("algorithm.batch_size: 3 must divide by policy.resources.ranks = 2") for x in lines)


def test_reward_model_takes_no_reference_and_needs_a_held_out_set(model, pairs):
    lines = errors(base(model, {"name": "rm", "dataset": pairs}))
    assert lines == ["reference: a reward model is trained without a reference model; set reference: null"]
    lines = errors(base(model, {"name": "rm", "dataset": pairs, "eval_fraction": 0}, reference=None))
    assert lines == ["algorithm.eval_fraction: 0 holds no pairs out and there is no algorithm.eval_dataset; "
                     "set one of them"]
    assert validate_dict(base(model, {"name": "rm", "dataset": pairs}, reference=None)).reference is None


def test_kto_options(model, tmp_path):
    lines = errors(base(model, {"name": "kto_online", "threshold": 0.5, "beta": -1, "mini_batch_size": 5},
                        reference=None, trainer={"prompts_per_step": 1, "samples_per_prompt": 4}))
    assert "algorithm.beta: must be > 0, got -1" in lines
    lines = errors(base(model, {"name": "kto_online", "mini_batch_size": 3}, reference=None,
                        trainer={"prompts_per_step": 1, "samples_per_prompt": 4}))
    assert any(x.startswith("algorithm.mini_batch_size: 3 must divide the rollout batch") for x in lines), lines
    assert any(x.startswith("reference: kto_online needs a frozen reference model") for x in lines), lines
    assert any(x.startswith("trainer.prompts_per_step: KTO's reference point needs") for x in lines), lines
    lines = errors(base(model, {"name": "kto_online", "desirable_weight": 1.33, "balance_ratio": 1.0,
                                "mini_batch_size": 32},
                        reference={}))
    assert lines == ["algorithm.desirable_weight: not used with algorithm.balance_ratio = 1.0 (w_d then follows "
                     "each step's class counts); remove one of them"], lines
    rows = str(write_jsonl([{"prompt": "1+1=", "completion": "2", "label": True}], tmp_path / "k.jsonl"))
    lines = errors(base(model, {"name": "kto", "dataset": rows, "balance_per_prompt": True}, reference={}))
    assert lines == ["algorithm.balance_per_prompt: needs algorithm.balance_ratio (e.g. 1.0)"], lines


def test_distill_options_are_checked_together(model, tmp_path):
    data = str(write_jsonl([{"prompt": "1+1=", "completion": "2"}], tmp_path / "teacher.jsonl"))
    ok = validate_dict(base(model, {"name": "distill", "mini_batch_size": 4}, reference=None, teacher={"model": model},
                            trainer={"prompts_per_step": 4, "samples_per_prompt": 1}))
    assert algorithm_options(ok).divergence == "reverse_kl"  # one sample per prompt: no group needed
    lines = errors(base(model, {"name": "distill", "mini_batch_size": 4, "jsd_beta": 0.3, "offline_dataset": data,
                                "advantage_estimator": "rloo"},
                        reference=None, teacher={"model": model}, trainer={"prompts_per_step": 4}))
    assert any(x.startswith("algorithm.jsd_beta: only used with algorithm.divergence: jsd") for x in lines), lines
    assert any(x.startswith("algorithm.offline_fraction: set offline_dataset and offline_fraction") for x in lines)
    assert any(x.startswith("algorithm.advantage_estimator: only used with") for x in lines), lines
    lines = errors(base(model, {"name": "distill", "mini_batch_size": 4, "task_reward_weight": 1.0}, reference=None,
                        teacher={"model": model}, trainer={"prompts_per_step": 4, "samples_per_prompt": 1}))
    assert lines == ["trainer.samples_per_prompt: estimator 'grpo' compares the samples of a prompt and needs at "
                     "least 2, got 1"]
