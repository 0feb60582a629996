"""Trainer updates on real tiny-model engines, in process (no Ray, ``LocalHandles``): the KTO
reference point from mismatched pairs, the critic-free advantages against reference loops, a
custom estimator registered here, and one DPO / reward-model step that moves the loss."""

import pytest
import torch

from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.base import Rollout
from xrlhf.algorithms.estimators import ADVANTAGE_ESTIMATORS
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.algorithms.functional import kl_penalized_rewards, masked_whiten, sequence_logprob
from xrlhf.algorithms.losses import SFTLoss
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.data.batch import build_sequences
from xrlhf.data.datasets import write_jsonl
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFInferEngine, HFTrainEngine
from xrlhf.envs import build_env
from xrlhf.models.tiny import build_model
from xrlhf.utils.run_hooks import RunHooks


def engine(handle):
    """The one engine of a one-rank local handle."""
    host = handle.hosts[0]
    return host.train or host.infer_engine


@ADVANTAGE_ESTIMATORS.register("test_row_score")
def row_score_estimator(scores, mask, group_ids, *, gamma=1.0, token_rewards=None, eps=1e-6):
    """A user's estimator: every token of a row gets the row's raw score."""
    return scores.unsqueeze(1) * mask


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


def make_trainer(model_dir, algorithm: dict, extra: dict | None = None, head="causal_lm"):
    cfg = validate_dict({"env": {"name": "reasoning"}, "policy": {"model": model_dir, "train": {"lr": 1e-3}},
                         "algorithm": algorithm, "trainer": {"prompts_per_step": 4, "samples_per_prompt": 2},
                         **(extra or {})})
    options = algorithm_options(cfg)
    spec = EngineSpec(model_path=model_dir, head=head, options={"lr": 1e-3, "micro_batch_size": 8}, seed=0)
    reference = None
    if cfg.reference is not None:
        reference = LocalHandle.of("reference", infer=HFInferEngine(EngineSpec(model_path=model_dir, seed=0)))
    handles = LocalHandles(LocalHandle.of("policy", train=HFTrainEngine(spec)), reference=reference)
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    return build_trainer(cfg, options, handles, env, load_tokenizer(model_dir), reward=None, hooks=RunHooks())


def seq_logps(engine, batch):
    return sequence_logprob(engine.infer(batch)["logprobs"], batch["response_mask"])


def test_online_kto_reference_point_is_policy_kl_on_mismatched_pairs(model_dir):
    trainer = make_trainer(model_dir, {"name": "kto_online", "mini_batch_size": 8, "beta": 0.5})
    policy, reference = engine(trainer.policy), engine(trainer.reference)
    prompts = [[1, 20, 21], [1, 20, 21], [1, 30], [1, 30]]
    completions = [[40, 2], [41, 42, 2], [43, 2], [2]]
    groups = torch.tensor([0, 0, 1, 1])  # 2 prompts x 2 samples: the mismatch is the other prompt's
    mism = build_sequences(prompts, [completions[j] for j in (2, 3, 0, 1)], pad_id=0)
    for _ in range(3):  # make the policy like the mismatched completions more than the reference does
        policy.train_step(mism, SFTLoss())

    train, kl = trainer.update.pairs.batches(prompts, completions, torch.tensor([True, False, True, False]), groups)
    pol, ref = seq_logps(policy, mism), seq_logps(reference, mism)
    want = float((pol - ref).mean().clamp(min=0))
    assert want > 0.01
    assert torch.allclose(kl["ref_logps"], ref, atol=1e-5)
    assert torch.allclose(train["ref_logps"], seq_logps(reference, build_sequences(prompts, completions, 0)), atol=1e-5)

    metrics = trainer.update.pairs.step(train, kl)
    assert torch.allclose(train["z_ref"], torch.full((4,), want), atol=1e-5)
    assert metrics["kto/kl"] == pytest.approx(want, abs=1e-5)
    assert metrics["kto/desirable_fraction"] == 0.5


def test_kto_balanced_weights_are_set_from_all_the_rows_of_an_update(model_dir):
    prompts = [[1, 20, 21]] * 4 + [[1, 30]] * 4
    completions = [[40, 2], [41, 2], [42, 2], [43, 2]] * 2
    labels = torch.tensor([True, False, False, False, True, True, True, False])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    fixed = make_trainer(model_dir, {"name": "kto_online", "mini_batch_size": 8, "desirable_weight": 1.5})
    assert fixed.update.pairs.batches(prompts, completions, labels, groups)[0]["desirable_weight"].tolist() == [1.5] * 8
    # one ratio over the 8 rows: n_d = n_u = 4 -> w_d = 4/3 * 1 * 4 / 4
    batch = make_trainer(model_dir, {"name": "kto_online", "mini_batch_size": 8, "balance_ratio": 4 / 3})
    assert batch.update.pairs.batches(prompts, completions, labels, groups)[0]["desirable_weight"].tolist() == \
        pytest.approx([4 / 3] * 8)
    # per prompt: prompt 0 has 1 desirable, 3 not -> 4/3 * 3 = 4; prompt 1 has 3 and 1 -> 4/3 / 3 = 4/9
    per = make_trainer(model_dir, {"name": "kto_online", "mini_batch_size": 8, "balance_ratio": 4 / 3,
                                   "balance_per_prompt": True})
    train, kl = per.update.pairs.batches(prompts, completions, labels, groups)
    assert train["desirable_weight"].tolist() == pytest.approx([4.0] * 4 + [4 / 9] * 4)
    # a mini-batch keeps its rows' weights (no recount on part of a prompt's samples)
    metrics = per.update.pairs.step(train.index(torch.tensor([0, 1, 4, 7])), kl.index(torch.tensor([0, 1, 4, 7])))
    assert metrics["kto/desirable_weight"] == pytest.approx((4.0 + 4 / 9) / 2)


def rollout_for(trainer, scores, group_ids, lengths):
    mask = torch.zeros(len(scores), max(lengths))
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    batch = build_sequences([[1]] * len(scores), [[5] * n for n in lengths], 0)
    batch["scores"] = torch.tensor(scores)
    batch["group_ids"] = torch.tensor(group_ids)
    batch["kl"] = 0.1 * mask
    return Rollout(batch, [], [])


GROUP_LOOP = {
    # the advantage of a row with score x in group g (list of scores), by a naive loop
    "grpo": lambda g, x: (x - sum(g) / len(g)) / ((sum((y - sum(g) / len(g)) ** 2 for y in g) / (len(g) - 1)) ** 0.5
                                                  + 1e-6),
    "dr_grpo": lambda g, x: x - sum(g) / len(g),
    "rloo": lambda g, x: x - (sum(g) - x) / (len(g) - 1),
}


@pytest.mark.parametrize("name", sorted(GROUP_LOOP))
def test_critic_free_advantages_match_reference_loop(model_dir, name):
    trainer = make_trainer(model_dir, {"name": name, "mini_batch_size": 8}, {"reference": None})
    scores, groups, lengths = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 2.0, 1.0], [0, 0, 0, 0, 1, 1, 1, 1], [2, 3, 1, 3, 3, 2, 1, 2]
    adv = trainer.update.advantages(rollout_for(trainer, scores, groups, lengths))
    for i, n in enumerate(lengths):
        group = [scores[k] for k in range(8) if groups[k] == groups[i]]
        want = GROUP_LOOP[name](group, scores[i])
        assert adv[i, :n].tolist() == pytest.approx([want] * n, abs=1e-5)
        assert adv[i, n:].abs().sum() == 0


def test_reinforce_pp_puts_the_kl_in_the_reward(model_dir):
    trainer = make_trainer(model_dir, {"name": "reinforce_pp", "mini_batch_size": 8, "kl_coef": 0.5,
                                       "kl_in_reward": True}, {"trainer": {"prompts_per_step": 8}})
    rollout = rollout_for(trainer, [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 2.0, 1.0], [0] * 8, [2, 3, 1, 3, 3, 2, 1, 2])
    b = rollout.batch
    mask = b["response_mask"]
    # reference loop: token rewards -0.5 * kl, plus the score on the last token; reward-to-go; whiten
    rewards = kl_penalized_rewards(b["scores"], b["kl"], mask, 0.5).tolist()
    returns = []
    for row, m in zip(rewards, mask.tolist()):
        g, out = 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            if m[t]:
                g = row[t] + g
                out[t] = g
        returns.append(out)
    want = masked_whiten(torch.tensor(returns), mask)
    assert torch.allclose(trainer.update.advantages(rollout), want, atol=1e-5)


def test_custom_estimator_registered_in_a_test_module_is_used(model_dir):
    trainer = make_trainer(model_dir, {"name": "critic_free", "advantage_estimator": "test_row_score",
                                       "mini_batch_size": 8}, {"reference": None})
    adv = trainer.update.advantages(rollout_for(trainer, [3.0, -1.0] * 4, [0, 0, 1, 1, 2, 2, 3, 3], [1, 2] * 4))
    assert adv[0].tolist() == [3.0, 0.0] and adv[1].tolist() == [-1.0, -1.0]
    metrics = trainer.update(rollout_for(trainer, [3.0, -1.0] * 4, [0, 0, 1, 1, 2, 2, 3, 3], [1, 2] * 4), {})
    assert "policy/loss" in metrics and metrics["advantages/abs_mean"] > 0


@pytest.mark.slow  # 36 training steps of two models (the e2e configs run both too)
def test_dpo_and_reward_model_steps_lower_their_loss(model_dir, tmp_path):
    data = tmp_path / "pairs.jsonl"
    write_jsonl([{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 3)} for a in range(8)], data)
    dpo = make_trainer(model_dir, {"name": "dpo", "dataset": str(data), "batch_size": 8, "beta": 0.5})
    first = dpo.step()["policy/loss"]
    for _ in range(5):
        last = dpo.step()["policy/loss"]
    assert first == pytest.approx(0.693147, abs=1e-4)  # policy == reference at the start: ln 2
    assert last < first - 0.01

    rm = make_trainer(model_dir, {"name": "rm", "dataset": str(data), "eval_dataset": str(data), "batch_size": 8},
                      {"reference": None}, head="score")
    before = rm.evaluate()
    for _ in range(30):
        rm.step()
    after = rm.evaluate()
    assert after["eval/accuracy"] == 1.0 and after["eval/margin"] > before["eval/margin"]


def test_online_kto_keeps_all_rows_or_only_mixed_groups(model_dir):
    labels = torch.tensor([True, False, True, True, False, False, True, False])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    plain = make_trainer(model_dir, {"name": "kto_online", "mini_batch_size": 8})
    assert plain.update.kept_rows(labels, groups).tolist() == list(range(8))
    mixed = make_trainer(model_dir, {"name": "kto_online", "mini_batch_size": 8, "filter_uniform_groups": True})
    assert mixed.update.kept_rows(labels, groups).tolist() == [0, 1, 6, 7]  # prompts 0 and 3 got both labels
    assert mixed.update.kept_rows(torch.tensor([True, False, True, True]), torch.tensor([0, 0, 1, 1])).tolist() == []
