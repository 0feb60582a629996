"""Hand-computed checks of xrlhf.algorithms.functional.

Every expected number below is worked out by hand in the comment next to it (4-6 significant
digits), never by re-running the formula under test.
"""

import math

import pytest
import torch

from xrlhf.algorithms.functional import (
    AdaptiveKLController,
    FixedKLController,
    bradley_terry_loss,
    discounted_returns,
    dpo_loss,
    entropy_from_logits,
    gae,
    kl_estimate,
    kl_penalized_rewards,
    kto_balanced_desirable_weights,
    kto_loss,
    kto_reference_point,
    masked_entropy_mean,
    masked_mean,
    masked_sum,
    masked_whiten,
    place_on_last_token,
    policy_loss,
    sequence_logprob,
    value_loss,
)

T = torch.tensor


def close(actual, expected, atol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32),
                          torch.as_tensor(expected, dtype=torch.float32), atol=atol), \
        f"{actual} != {expected}"


# --- masked reductions -----------------------------------------------------------------------


def test_masked_sum_mean_ignore_padding_even_if_inf():
    x = T([[1.0, 2.0, float("inf")], [4.0, float("nan"), 6.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    # sum = 1 + 2 + 4 + 6 = 13; 4 real tokens -> mean 13 / 4 = 3.25
    close(masked_sum(x, mask), 13.0)
    close(masked_mean(x, mask), 3.25)
    # per row: (1 + 2) / 2 = 1.5; (4 + 6) / 2 = 5
    close(masked_mean(x, mask, dim=-1), [1.5, 5.0])
    close(masked_sum(x, mask, dim=-1), [3.0, 10.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_whiten():
    x = T([[1.0, 3.0, 100.0]])
    mask = T([[1.0, 1.0, 0.0]])
    # mean of {1, 3} = 2; biased var = ((-1)^2 + 1^2) / 2 = 1 -> (x - 2) / 1 = [-1, 1], pad 0
    close(masked_whiten(x, mask), [[-1.0, 1.0, 0.0]])
    # shift_mean=False adds the mean back: [1, 3]
    close(masked_whiten(x, mask, shift_mean=False), [[1.0, 3.0, 0.0]])


def test_place_on_last_token():
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # last real token: index 2, index 1, none
    close(place_on_last_token(T([1.0, 2.0, 3.0]), mask),
          [[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])


def test_discounted_returns():
    rewards = T([[1.0, 0.0, 2.0], [1.0, 5.0, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    # row 0, gamma 0.5: G2 = 2; G1 = 0 + 0.5 * 2 = 1; G0 = 1 + 0.5 * 1 = 1.5
    # row 1: position 1 is masked and skipped: G2 = 9; G1 -> 0 (pad); G0 = 1 + 0.5 * 9 = 5.5
    close(discounted_returns(rewards, mask, 0.5), [[1.5, 1.0, 2.0], [5.5, 0.0, 9.0]])


# --- GAE -------------------------------------------------------------------------------------


def test_gae_hand_computed_full_and_padded_row():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = T([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # gamma * lam = 0.72
    # row 0 (all real):
    #   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3;                  A2 = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.63 - 0.6 = 0.03;  A1 = 0.03 + 0.72*0.3 = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.54 - 0.5 = 0.04;  A0 = 0.04 + 0.72*0.246 = 0.21712
    #   returns = A + V = [0.71712, 0.846, 1.0]
    # row 1 (mask [1,1,0]: t=1 is terminal, the 5.0 reward and 9.0 value at t=2 are ignored):
    #   t=2: padding -> A2 = 0
    #   t=1: delta = 1 + 0.9*0 - 0.6 = 0.4;                  A1 = 0.4
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;               A0 = 0.04 + 0.72*0.4 = 0.328
    #   returns = [0.828, 1.0, (pad)]
    close(adv, [[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0]])
    close(ret[0], [0.71712, 0.846, 1.0])
    close(ret[1, :2], [0.828, 1.0])


def test_gae_interior_masked_token_is_bridged():
    rewards = T([[0.0, 7.0, 1.0]])
    values = T([[0.5, 9.0, 0.7]])
    mask = T([[1.0, 0.0, 1.0]])
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=2: A2 = 1 - 0.7 = 0.3; t=1 skipped (A1 = 0);
    # t=0: next real value is V2 = 0.7: delta = 0.9*0.7 - 0.5 = 0.13; A0 = 0.13 + 0.72*0.3 = 0.346
    close(adv, [[0.346, 0.0, 0.3]])


# --- PPO losses ------------------------------------------------------------------------------


def _policy_case():
    # ratios new/old = 0.6/0.4 = 1.5, 0.45/0.5 = 0.9, 0.25/0.5 = 0.5
    logprobs = torch.log(T([[0.6, 0.45, 0.25]]))
    old = torch.log(T([[0.4, 0.5, 0.5]]))
    advantages = T([[2.0, -1.0, 1.0]])
    return logprobs, old, advantages


def test_policy_loss_one_token_clipped():
    logprobs, old, adv = _policy_case()
    mask = torch.ones(1, 3)
    logprobs.requires_grad_(True)
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    # token 0: ratio 1.5, A=2:  -1.5*2 = -3.0; clipped ratio 1.2 -> -2.4; max = -2.4 (CLIPPED)
    # token 1: ratio 0.9, A=-1: 0.9 both (0.9 is inside [0.8, 1.2])
    # token 2: ratio 0.5, A=1:  -0.5 unclipped; clipped 0.8 -> -0.8; max = -0.5 (not clipped)
    # sum = -2.4 + 0.9 - 0.5 = -2.0
    close(loss, -2.0)
    close(stats["clip_frac"], 1 / 3)
    # ratio_mean = (1.5 + 0.9 + 0.5) / 3 = 2.9 / 3 = 0.966667
    close(stats["ratio_mean"], 0.966667)
    # k3 = ratio - 1 - ln(ratio):
    #   1.5: 0.5 - 0.405465 = 0.094535
    #   0.9: -0.1 + 0.105361 = 0.005361
    #   0.5: -0.5 + 0.693147 = 0.193147
    #   mean = 0.293043 / 3 = 0.097681
    close(stats["approx_kl"], 0.097681)
    loss.backward()
    # the clipped token has no gradient; d(-A*ratio)/dlogp = -A*ratio:
    #   token 1 -> 0.9, token 2 -> -0.5
    close(logprobs.grad, [[0.0, 0.9, -0.5]])


def test_policy_loss_clip_higher_mask_and_is_weights():
    logprobs, old, adv = _policy_case()
    # clip_eps_high = 0.6: 1.5 < 1.6, token 0 is not clipped: -3.0 + 0.9 - 0.5 = -2.6
    loss, stats = policy_loss(logprobs, old, adv, torch.ones(1, 3), 0.2, clip_eps_high=0.6)
    close(loss, -2.6)
    close(stats["clip_frac"], 0.0)
    # mask [1,1,0] drops token 2: -2.4 + 0.9 = -1.5
    loss, _ = policy_loss(logprobs, old, adv, T([[1.0, 1.0, 0.0]]), 0.2)
    close(loss, -1.5)
    # is_weights [0.5, 1, 2]: -2.4*0.5 + 0.9*1 - 0.5*2 = -1.2 + 0.9 - 1.0 = -1.3
    loss, _ = policy_loss(logprobs, old, adv, torch.ones(1, 3), 0.2,
                          is_weights=T([[0.5, 1.0, 2.0]]))
    close(loss, -1.3)


def test_value_loss_clipped_and_unclipped():
    values = T([[1.0, 2.0, 1.0]])
    old_values = T([[0.8, 1.5, 0.5]])
    returns = T([[1.5, 1.0, 2.0]])
    mask = torch.ones(1, 3)
    loss, stats = value_loss(values, old_values, returns, mask, clip_eps=0.2)
    # token 0: v=1.0 inside [0.6, 1.0];  (1-1.5)^2 = 0.25 both           -> 0.25
    # token 1: v=2.0 -> clip 1.7; (2-1)^2 = 1 vs (1.7-1)^2 = 0.49        -> 1    (unclipped)
    # token 2: v=1.0 -> clip 0.7; (1-2)^2 = 1 vs (0.7-2)^2 = 1.69        -> 1.69 (clipped)
    # loss = 0.5 * (0.25 + 1 + 1.69) = 1.47
    close(loss, 1.47)
    close(stats["vf_clip_frac"], 1 / 3)
    close(stats["value_mean"], 4 / 3)  # (1 + 2 + 1) / 3
    # no clip: 0.5 * (0.25 + 1 + 1) = 1.125
    loss, stats = value_loss(values, old_values, returns, mask, clip_eps=None)
    close(loss, 1.125)
    close(stats["vf_clip_frac"], 0.0)
    # mask [1,0,1]: 0.5 * (0.25 + 1.69) = 0.97
    loss, _ = value_loss(values, old_values, returns, T([[1.0, 0.0, 1.0]]), clip_eps=0.2)
    close(loss, 0.97)


# --- KL --------------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    logprobs = torch.log(T([[0.5, 0.25]]))
    ref = torch.log(T([[0.25, 0.5]]))
    # token 0: logp - ref = ln 0.5 - ln 0.25 = ln 2 = 0.693147; token 1: -ln 2
    close(kl_estimate(logprobs, ref, "k1"), [[0.693147, -0.693147]])
    # k2 = 0.5 * (ln 2)^2 = 0.5 * 0.480453 = 0.240227 for both
    close(kl_estimate(logprobs, ref, "k2"), [[0.240227, 0.240227]])
    # k3 = exp(d) - d - 1 with d = ref - logp:
    #   token 0: d = -ln 2: 0.5 + 0.693147 - 1 = 0.193147
    #   token 1: d = +ln 2: 2 - 0.693147 - 1 = 0.306853
    close(kl_estimate(logprobs, ref, "k3"), [[0.193147, 0.306853]])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logprobs, ref, "k4")


def test_kl_penalized_rewards():
    kl = T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # coef 0.5: row 0 = [-0.05, -0.1, -0.15 + 1.0 = 0.85]
    #           row 1 = [-0.2, -0.25 + 2.0 = 1.75, 0 (pad)]
    close(kl_penalized_rewards(T([1.0, 2.0]), kl, mask, 0.5),
          [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 256)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_kl_controller_one_update():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    # KL 9: err = 9/6 - 1 = 0.5 -> clipped to 0.2; coef *= 1 + 0.2*256/10000 = 1.00512 -> 0.100512
    ctl.update(9.0, 256)
    assert ctl.value == pytest.approx(0.100512)
    # KL 5.4: err = 0.9 - 1 = -0.1; coef *= 1 - 0.1*256/10000 = 0.99744
    #   0.100512 * 0.99744 = 0.100512 - 0.100512*0.00256 = 0.100512 - 0.000257311 = 0.100254689
    ctl.update(5.4, 256)
    assert ctl.value == pytest.approx(0.100254689)
    restored = AdaptiveKLController(1.0, 1.0, 1)
    restored.load_state_dict(ctl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (ctl.value, 6.0, 10000)
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


# --- entropy ---------------------------------------------------------------------------------


def test_entropy_from_logits():
    # uniform over 2 -> ln 2 = 0.693147, also for huge logits (stability)
    # [0, ln 3] -> p = [1/4, 3/4]; H = 0.25*ln 4 + 0.75*ln(4/3) = 0.346574 + 0.215762 = 0.562335
    # [0, -inf] -> p = [1, 0] -> H = 0 (no nan from 0 * -inf)
    logits = T([[0.0, 0.0], [1000.0, 1000.0], [0.0, math.log(3.0)], [0.0, float("-inf")]])
    close(entropy_from_logits(logits), [0.693147, 0.693147, 0.562335, 0.0])


def test_entropy_gradient_is_finite_with_banned_tokens():
    logits = T([[0.0, 0.0, float("-inf")]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    # H = ln 2 at the uniform point over the two allowed tokens: a maximum, so dH/dx = 0
    close(logits.grad, [[0.0, 0.0, 0.0]])


def test_masked_entropy_mean():
    logits = T([[[0.0, 0.0], [0.0, math.log(3.0)], [5.0, 5.0]]])  # [1, 3, 2]
    mask = T([[1.0, 1.0, 0.0]])
    # (0.693147 + 0.562335) / 2 = 0.627741
    close(masked_entropy_mean(logits, mask), 0.627741)


# --- sequence-level losses -------------------------------------------------------------------


def test_sequence_logprob():
    # row 0: -1 - 2 = -3 (third token padded); row 1: -0.5 - 0.5 - 1 = -2
    logprobs = T([[-1.0, -2.0, -9.0], [-0.5, -0.5, -1.0]])
    close(sequence_logprob(logprobs, T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])), [-3.0, -2.0])


def test_kto_reference_point_from_mismatched_pairs():
    # differences: -5 - (-6) = 1; -7 - (-6.5) = -0.5; mean = 0.5 / 2 = 0.25
    z = kto_reference_point(T([-5.0, -7.0]), T([-6.0, -6.5]))
    close(z, 0.25)
    assert not z.requires_grad
    # negative mean is clamped to 0: diffs -1, -0.5 -> mean -0.75 -> 0
    close(kto_reference_point(T([-7.0, -7.0]), T([-6.0, -6.5])), 0.0)


def test_kto_loss_one_desirable_one_undesirable():
    policy = T([-3.75, -8.0], requires_grad=True)
    ref = T([-6.0, -8.25])
    labels = T([True, False])
    loss, stats = kto_loss(policy, ref, labels, z_ref=T(0.25), beta=0.5,
                           desirable_weight=1.0, undesirable_weight=1.5)
    # r = [2.25, 0.25]
    # desirable:   beta*(r - z) = 0.5*(2.25 - 0.25) = 1; sigmoid(1) = 1/(1 + e^-1)
    #              = 1/1.367879 = 0.731059 -> 1.0 * (1 - 0.731059) = 0.268941
    # undesirable: beta*(z - r) = 0.5*(0.25 - 0.25) = 0; sigmoid(0) = 0.5 -> 1.5 * 0.5 = 0.75
    # sum = 1.018941
    close(loss, 1.018941)
    # implicit rewards beta*r: chosen 0.5*2.25 = 1.125, rejected 0.5*0.25 = 0.125
    close(stats["rewards_chosen"], 1.125)
    close(stats["rewards_rejected"], 0.125)
    close(stats["kl"], 0.25)
    loss.backward()
    # d/dpolicy of w*(1 - sigmoid(x)) = -w * s(1-s) * dx/dpolicy:
    #   desirable: x = beta*(r - z): -1 * 0.731059*0.268941 * 0.5 = -0.098305
    #   undesirable: x = beta*(z - r): -1.5 * 0.25 * (-0.5) = 0.1875
    close(policy.grad, [-0.098305, 0.1875])


def test_kto_loss_absent_class_gives_zero_stat():
    _, stats = kto_loss(T([-1.0, -2.0]), T([-1.5, -2.5]), T([True, True]), 0.0, 0.1, 1.0, 1.0)
    # rejected rows absent -> 0.0, not nan; chosen = 0.1 * 0.5 = 0.05
    close(stats["rewards_rejected"], 0.0)
    close(stats["rewards_chosen"], 0.05)


def test_kto_loss_with_per_row_desirable_weights():
    # the rows of test_kto_loss_one_desirable_one_undesirable plus a second desirable row with
    # r = -1.75 - (-2) = 0.25: beta*(r - z) = 0 -> 1 - sigmoid(0) = 0.5
    policy = T([-3.75, -8.0, -1.75], requires_grad=True)
    loss, _ = kto_loss(policy, T([-6.0, -8.25, -2.0]), T([True, False, True]), z_ref=T(0.25), beta=0.5,
                       desirable_weight=T([2.0, 7.0, 3.0]), undesirable_weight=1.5)
    # 2 * 0.268941 + 1.5 * 0.5 (row 1 is undesirable: its w_d of 7 is unused) + 3 * 0.5
    # = 0.537882 + 0.75 + 1.5 = 2.787882
    close(loss, 2.787882)
    loss.backward()
    # desirable rows: -w_d * s(1-s) * beta: -2 * 0.196612 * 0.5 = -0.196612; -3 * 0.25 * 0.5 = -0.375
    close(policy.grad, [-0.196612, 0.1875, -0.375])


def test_kto_balanced_desirable_weights_per_batch_and_per_group():
    labels = T([True, False, False, False, True, True, False, True])
    # one group: n_d = 4, n_u = 4 -> w_d = ratio * w_u * n_u / n_d = 1.25 * 2 * 4 / 4 = 2.5
    close(kto_balanced_desirable_weights(labels, torch.zeros(8, dtype=torch.long), 1.25, 2.0), [2.5] * 8)
    # groups 5: rows 0-3 (1 desirable, 3 undesirable) -> 1.25 * 2 * 3 / 1 = 7.5
    #        9: rows 4-6 (2 desirable, 1 undesirable) -> 1.25 * 2 * 1 / 2 = 1.25
    #        2: row 7 (desirable only, no ratio to keep) -> ratio * w_u = 2.5
    groups = T([5, 5, 5, 5, 9, 9, 9, 2])
    w = kto_balanced_desirable_weights(labels, groups, 1.25, 2.0)
    close(w, [7.5, 7.5, 7.5, 7.5, 1.25, 1.25, 1.25, 2.5])
    # the paper's ratio holds within each mixed group: 7.5 * 1 / (2 * 3) = 1.25; 1.25 * 2 / (2 * 1) = 1.25
    assert not w.requires_grad


def test_dpo_loss():
    # row 0: (pc - rc) - (pr - rr) = (-10 + 12) - (-15 + 13) = 2 + 2 = 4; beta*4 = 0.4
    #        -logsigmoid(0.4) = ln(1 + e^-0.4) = ln(1.670320) = 0.513015
    # row 1: all equal -> 0 -> ln 2 = 0.693147
    # sum = 1.206162
    loss, stats = dpo_loss(T([-10.0, -5.0]), T([-15.0, -5.0]), T([-12.0, -5.0]),
                           T([-13.0, -5.0]), beta=0.1)
    close(loss, 1.206162)
    # rewards: row 0 chosen 0.2 > rejected -0.2; row 1 tie (not >) -> accuracy 0.5
    close(stats["reward_accuracy"], 0.5)
    close(stats["reward_margin"], 0.2)  # (0.4 + 0) / 2


def test_bradley_terry_loss():
    # c - r = [1, -1]: ln(1 + e^-1) = ln 1.367879 = 0.313262; ln(1 + e) = ln 3.718282 = 1.313262
    # sum = 1.626524
    loss, stats = bradley_terry_loss(T([2.0, 0.0]), T([1.0, 1.0]))
    close(loss, 1.626524)
    close(stats["accuracy"], 0.5)
    close(stats["margin"], 0.0)


def test_shape_mismatch_names_tensors():
    with pytest.raises(ValueError, match="old_logprobs=\\(1, 2\\)"):
        policy_loss(torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 3), 0.2)
