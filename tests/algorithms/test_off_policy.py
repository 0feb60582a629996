"""Off-policy correction (``algorithms/off_policy.py``): the behaviour weights of tis / mis at
token and sequence level against hand-computed numbers, their stats, the staleness metrics,
``PolicyLoss`` with ``off_policy`` (rejected tokens leave the loss sum, not the denominator),
``tis_cap`` unchanged, and the ``algorithm.off_policy`` config rules."""

import math
import pickle

import pytest
import torch

from xrlhf.algorithms import functional as F
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.algorithms.off_policy import MAX_LOG_WEIGHT, OffPolicy, is_weights, staleness_metrics
from xrlhf.algorithms.policy_update import policy_loss
from xrlhf.data.batch import Batch
from xrlhf.engines.base import ForwardOutput
from xrlhf.engines.training import loss_units
from xrlhf.utils.errors import UserError
from xrlhf.validation import algorithm_options, validate_dict

T = torch.tensor

# Two rows, 3 and 2 response tokens (5 in all), one padding position in row 0, two in row 1.
# The behaviour weights w = exp(old - rollout) of the response tokens:
#   row 0: [3, 0.25, 1.5]   row 1: [0.4, 1.25]
# raw token mean (3 + 0.25 + 1.5 + 0.4 + 1.25) / 5 = 6.4 / 5 = 1.28
# sequence weights (products): row 0: 3 * 0.25 * 1.5 = 1.125; row 1: 0.4 * 1.25 = 0.5
# token-weighted sequence mean: (3 * 1.125 + 2 * 0.5) / 5 = 4.375 / 5 = 0.875
MASK = T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
W = [[3.0, 0.25, 1.5, 1.0], [0.4, 1.25, 1.0, 1.0]]
ROLLOUT = T([[-2.0, -1.0, -0.5, 0.0], [-3.0, -1.5, 0.0, 0.0]])  # 0 on padding, as generated
OLD = (ROLLOUT + torch.log(T(W))) * MASK


def close(x, want, tol=1e-5):
    assert torch.allclose(torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                          atol=tol), (x, want)


def weights(correction, level, cap=2.0, bounds=(0.5, 2.0), old=OLD, rollout=ROLLOUT, mask=MASK):
    return is_weights(old, rollout, mask, correction, level, cap, bounds)


def test_token_tis_truncates_at_the_cap():
    w, keep, stats = weights("tis", "token", cap=2.0)
    close(w, [[2.0, 0.25, 1.5, 1.0], [0.4, 1.25, 1.0, 1.0]])  # 3 -> 2; padding neutral (1)
    assert keep.tolist() == [[1.0] * 4, [1.0] * 4]
    close(stats["clipped_frac"], 0.2)  # 1 of 5 tokens truncated
    close(stats["masked_frac"], 0.0)
    close(stats["weight_mean"], 1.28)  # the raw weight, before truncation


def test_token_mis_masks_tokens_outside_the_bounds_and_keeps_w_on_the_rest():
    w, keep, stats = weights("mis", "token", bounds=(0.5, 2.0))
    # 3 > 2, 0.25 < 0.5 and 0.4 < 0.5 are rejected; 1.5 and 1.25 keep their raw weight
    assert keep.tolist() == [[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]]
    close(w, [[0.0, 0.0, 1.5, 1.0], [0.0, 1.25, 1.0, 1.0]])
    close(stats["masked_frac"], 0.6)  # 3 of 5
    close(stats["clipped_frac"], 0.0)
    close(stats["weight_mean"], 1.28)


def test_sequence_tis_uses_the_product_of_the_row():
    w, keep, stats = weights("tis", "sequence", cap=1.0)
    # row 0: 1.125 -> 1 (truncated: its 3 tokens count as clipped); row 1: 0.5 stays
    close(w, [[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 1.0, 1.0]])
    assert keep.tolist() == [[1.0] * 4, [1.0] * 4]
    close(stats["clipped_frac"], 0.6)  # 3 of 5 tokens, token-weighted
    close(stats["weight_mean"], 0.875)
    w, _, stats = weights("tis", "sequence", cap=2.0)
    close(w, [[1.125, 1.125, 1.125, 1.0], [0.5, 0.5, 1.0, 1.0]])
    close(stats["clipped_frac"], 0.0)


def test_sequence_mis_keeps_or_rejects_whole_rows():
    w, keep, stats = weights("mis", "sequence", bounds=(0.6, 2.0))
    # row 0: 1.125 in [0.6, 2] kept, its tokens weigh 1.125; row 1: 0.5 < 0.6, rejected whole
    assert keep.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]
    close(w, [[1.125, 1.125, 1.125, 1.0], [0.0, 0.0, 1.0, 1.0]])
    close(stats["masked_frac"], 0.4)  # row 1's 2 tokens of 5
    close(stats["weight_mean"], 0.875)


def test_none_changes_nothing_but_measures():
    w, keep, stats = weights("none", "token")
    assert torch.equal(w, torch.ones(2, 4)) and torch.equal(keep, torch.ones(2, 4))
    close(stats["clipped_frac"], 0.0)
    close(stats["masked_frac"], 0.0)
    close(stats["weight_mean"], 1.28)


def test_mis_bounds_are_inclusive():
    # old == rollout: w = exp(0) = 1 exactly, on a bound either way
    zeros, ones = torch.zeros(1, 2), torch.ones(1, 2)
    for bounds in ((1.0, 1.5), (0.5, 1.0)):
        _, keep, _ = is_weights(zeros, zeros, ones, "mis", "token", bounds=bounds)
        assert keep.tolist() == [[1.0, 1.0]]


def test_log_weight_is_clamped_and_padding_is_ignored():
    # a row of 30 tokens with log-ratio 1 each: sum 30 -> clamped to 20; w = exp(20), finite
    old, rollout, mask = torch.ones(1, 30), torch.zeros(1, 30), torch.ones(1, 30)
    w, _, stats = is_weights(old, rollout, mask, "none", "sequence")
    close(stats["weight_mean"], math.exp(MAX_LOG_WEIGHT), tol=1.0)
    # one token 25 nats off: exp(20); truncated by tis
    w, _, stats = is_weights(T([[25.0]]), T([[0.0]]), T([[1.0]]), "tis", "token", cap=2.0)
    close(w, [[2.0]])
    close(stats["clipped_frac"], 1.0)
    # nan / inf on padding positions do not leak into the weights or the stats
    old = OLD.clone()
    old[0, 3], old[1, 2] = float("nan"), float("-inf")
    for level in ("token", "sequence"):
        w, keep, stats = weights("mis", level, old=old)
        assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in stats.values())


def test_is_weights_rejects_bad_arguments():
    with pytest.raises(ValueError, match="correction must be"):
        weights("clip", "token")
    with pytest.raises(ValueError, match="level must be"):
        weights("tis", "geometric")
    with pytest.raises(ValueError, match="one shape"):
        is_weights(OLD, ROLLOUT[:, :3], MASK)
    with pytest.raises(ValueError, match="0 <= lo < hi"):
        weights("mis", "token", bounds=(2.0, 0.5))


def test_staleness_metrics():
    # policy version 5; versions of the response tokens: row 0 [5, 4, 4], row 1 [3, 3] -> staleness
    # [0, 1, 1, 2, 2]: min 0, mean 6 / 5 = 1.2, max 2 (padding versions 0 are ignored)
    versions = T([[5, 4, 4, 0], [3, 3, 0, 0]])
    rollout = T([[-1.0, -1.0, -1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    # |old - rollout|: row 0 [0.1, 0.3, 0.5], row 1 [0.2, 0.6]
    old = rollout + T([[0.1, -0.3, 0.5, 7.0], [-0.2, 0.6, 9.0, 9.0]])
    m = staleness_metrics(old, rollout, versions, MASK, policy_version=5)
    assert set(m) == {"staleness/min", "staleness/mean", "staleness/max", "staleness/mixed_frac",
                      "mismatch/abs_diff_s0", "mismatch/abs_diff_s1", "mismatch/abs_diff_s2"}
    assert (m["staleness/min"], m["staleness/max"]) == (0.0, 2.0)
    assert m["staleness/mixed_frac"] == 0.5  # row 0 was sampled by versions 5 and 4, row 1 by 3 alone
    close(m["staleness/mean"], 1.2)
    close(m["mismatch/abs_diff_s0"], 0.1)  # one token
    close(m["mismatch/abs_diff_s1"], 0.4)  # (0.3 + 0.5) / 2
    close(m["mismatch/abs_diff_s2"], 0.4)  # (0.2 + 0.6) / 2
    empty = staleness_metrics(old, rollout, versions, torch.zeros(2, 4), policy_version=5)
    assert empty == {"staleness/min": 0.0, "staleness/mean": 0.0, "staleness/max": 0.0, "staleness/mixed_frac": 0.0}


# -- PolicyLoss --------------------------------------------------------------------------------


def policy_batch():
    return Batch({"response_mask": MASK.clone(), "old_logprobs": OLD.clone(), "rollout_logprobs": ROLLOUT.clone(),
                  "advantages": T([[1.0, -2.0, 0.5, 0.0], [2.0, -1.0, 0.0, 0.0]])})


def test_policy_loss_with_mis_leaves_rejected_tokens_out_of_the_sum_only():
    # logprobs == old: ratio 1, no clipping; each token's term is -w * A.
    # token mis (0.5, 2): w = [0, 0, 1.5 | 0, 1.25], A = [1, -2, 0.5 | 2, -1]
    # loss sum = -(1.5 * 0.5 + 1.25 * -1) = -(0.75 - 1.25) = 0.5
    # entropy 0.5 on every token, coef 0.1: the bonus covers all 5 tokens: 0.5 - 0.1 * 2.5 = 0.25
    mb = policy_batch()
    logprobs = OLD.clone().requires_grad_(True)
    out = ForwardOutput(logprobs=logprobs, entropy=torch.full((2, 4), 0.5))
    loss_fn = PolicyLoss(entropy_coef=0.1, off_policy=OffPolicy("mis", "token", bounds=(0.5, 2.0)))
    loss, metrics = loss_fn(out, mb)
    close(loss, 0.25)
    close(metrics["policy/pg_loss"], 0.5 / 5)  # the denominator still counts the 3 rejected tokens
    close(metrics["off_policy/masked_frac"], 0.6)
    close(metrics["off_policy/clipped_frac"], 0.0)
    close(metrics["off_policy/weight_mean"], 1.28)
    assert all(v.dim() == 0 for v in metrics.values())
    # the engine divides by the batch's response tokens, which the loss leaves as they were: 5
    assert torch.equal(mb["response_mask"], MASK) and float(loss_units(mb, "token")) == 5.0
    loss.backward()
    # d/dlogprob of -w * A * ratio at ratio 1: -w * A; rejected tokens get no gradient
    close(logprobs.grad, [[0.0, 0.0, -0.75, 0.0], [0.0, 1.25, 0.0, 0.0]])


def test_policy_loss_with_token_tis():
    # w = [2, 0.25, 1.5 | 0.4, 1.25]: sum w * A = 2 - 0.5 + 0.75 + 0.8 - 1.25 = 1.8 -> loss -1.8
    loss, metrics = PolicyLoss(off_policy=OffPolicy("tis", "token", cap=2.0))(ForwardOutput(logprobs=OLD.clone()),
                                                                               policy_batch())
    close(loss, -1.8)
    close(metrics["off_policy/clipped_frac"], 0.2)


def test_tis_cap_is_unchanged():
    # the numbers of tis_cap before off_policy existed: exp(old - rollout) clamped, unmasked
    torch.manual_seed(0)
    mask = (torch.rand(4, 6) > 0.25).float()
    old, rollout, adv = -torch.rand(4, 6) * 3, -torch.rand(4, 6) * 3, torch.randn(4, 6)
    logprobs = -torch.rand(4, 6) * 3
    mb = Batch({"response_mask": mask, "old_logprobs": old, "rollout_logprobs": rollout, "advantages": adv})
    loss, metrics = PolicyLoss(clip_eps=0.2, tis_cap=1.5)(ForwardOutput(logprobs=logprobs), mb)
    want, stats = F.policy_loss(logprobs, old, adv, mask, 0.2, None, torch.exp(old - rollout).clamp(max=1.5))
    assert torch.equal(loss, want)
    assert not any(k.startswith("off_policy/") for k in metrics)
    assert all(torch.equal(metrics[f"policy/{k}"], v) for k, v in stats.items())
    # off_policy's token tis is the same estimator (it only clamps log w to +-20 and ignores padding)
    loss2, _ = PolicyLoss(clip_eps=0.2, off_policy=OffPolicy("tis", "token", cap=1.5))(
        ForwardOutput(logprobs=logprobs), mb)
    close(loss2, want)


def test_policy_loss_takes_one_correction_and_pickles():
    with pytest.raises(ValueError, match="tis_cap or off_policy"):
        PolicyLoss(tis_cap=2.0, off_policy=OffPolicy())
    loss_fn = PolicyLoss(off_policy=OffPolicy("mis", "sequence", bounds=(0.25, 4.0)))
    assert pickle.loads(pickle.dumps(loss_fn)) == loss_fn


# -- algorithm.off_policy --------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from xrlhf.models.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("m") / "tiny"))


def config(model, algorithm=None, **sections):
    return {"env": {"name": "reasoning"}, "policy": {"model": model},
            "algorithm": {"name": "grpo", "mini_batch_size": 8, **(algorithm or {})},
            "trainer": {"prompts_per_step": 4, "samples_per_prompt": 4}, **sections}


def errors(data: dict) -> list[str]:
    with pytest.raises(UserError) as e:
        validate_dict(data)
    return e.value.messages


STALE = {"rollout": {"max_staleness": 1}}
NEEDS = ("algorithm.off_policy: max_staleness > 0 trains on samples of older policies; add "
         "algorithm.off_policy: {correction: tis} (or mis), or set tis_cap")


def test_off_policy_block_defaults_and_reaches_the_loss(model):
    assert algorithm_options(validate_dict(config(model))).off_policy is None
    o = algorithm_options(validate_dict(config(model, {"off_policy": {}})))
    assert (o.off_policy.correction, o.off_policy.level, o.off_policy.cap, o.off_policy.bounds) == \
        ("tis", "token", 2.0, (0.5, 2.0))
    o = algorithm_options(validate_dict(config(model, {"off_policy": {"correction": "mis", "level": "sequence",
                                                                      "bounds": [0.25, 4]}})))
    assert policy_loss(o, 0.0).off_policy == OffPolicy("mis", "sequence", 2.0, (0.25, 4.0))
    o = algorithm_options(validate_dict(config(model, {"tis_cap": 3.0})))
    loss_fn = policy_loss(o, 0.0)
    assert (loss_fn.tis_cap, loss_fn.off_policy) == (3.0, None)


def test_off_policy_option_errors(model):
    lines = errors(config(model, {"off_policy": {"bounds": [2, 0.5], "cap": 0, "level": "row", "x": 1}}))
    assert "algorithm.off_policy.bounds: [lo, hi] needs 0 <= lo < hi, got [2.0, 0.5]" in lines
    assert "algorithm.off_policy.cap: must be > 0, got 0" in lines
    assert any(x.startswith("algorithm.off_policy.level:") for x in lines), lines
    assert "algorithm.off_policy.x: unknown key (valid: bounds, cap, correction, level)" in lines
    assert errors(config(model, {"off_policy": {"correction": "mis", "cap": 3}})) == [
        "algorithm.off_policy.cap: not used by correction 'mis' (tis only); remove it"]
    assert errors(config(model, {"off_policy": {"bounds": [0.1, 3]}})) == [
        "algorithm.off_policy.bounds: not used by correction 'tis' (mis only); remove it"]


def test_tis_cap_and_off_policy_together_is_an_error(model):
    assert errors(config(model, {"tis_cap": 2.0, "off_policy": {"correction": "mis"}})) == [
        "algorithm.off_policy: set together with algorithm.tis_cap (2.0); tis_cap is off_policy {correction: tis, "
        "level: token, cap: 2.0}: remove one of them"]


def test_staleness_needs_a_correction(model):
    assert errors(config(model, **STALE)) == [NEEDS]
    assert errors(config(model, {"off_policy": {"correction": "none"}}, **STALE)) == [NEEDS]
    for algorithm in ({"tis_cap": 2.0}, {"off_policy": {}}, {"off_policy": {"correction": "mis"}}):
        validate_dict(config(model, algorithm, **STALE))
    # PPO shares the rule (PolicyGradientConfig)
    ppo = config(model, {"name": "ppo"}, critic={}, **STALE)
    assert errors(ppo) == [NEEDS]
