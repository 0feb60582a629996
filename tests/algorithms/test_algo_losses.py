"""The loss callables of DPO, KTO and the reward model against hand-computed numbers, and the
pieces of the KTO update: mismatched pairs, the reference point, sequence unpacking."""

import math

import pytest
import torch

from xrlhf.algorithms.kto import mismatch_index
from xrlhf.data.batch import unpack_sequences
from xrlhf.algorithms.losses import DPOLoss, KTOLoss, PairwiseRewardLoss
from xrlhf.algorithms.offline import pair_batch
from xrlhf.data.batch import Batch, build_sequences
from xrlhf.engines.base import ForwardOutput

T = torch.tensor


def close(x, want, tol=1e-5):
    assert torch.allclose(torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                          atol=tol), (x, want)


def test_kto_loss_callable_sums_rows_and_uses_z_ref():
    # two rows, sequence logprobs from the masked token logprobs:
    #   row 0: -1.5 - 2.25 = -3.75 (third token padded), row 1: -3 - 5 = -8
    logprobs = T([[-1.5, -2.25, -9.0], [-3.0, -5.0, -99.0]], requires_grad=True)
    mb = Batch({"response_mask": T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]), "ref_logps": T([-6.0, -8.25]),
                "labels": T([1.0, 0.0]), "z_ref": T([0.25, 0.25])})
    loss, metrics = KTOLoss(beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)(ForwardOutput(logprobs=logprobs), mb)
    # r = [2.25, 0.25]; desirable 1 - sigmoid(0.5 * (2.25 - 0.25)) = 1 - 0.731059 = 0.268941;
    # undesirable 1.5 * (1 - sigmoid(0.5 * (0.25 - 0.25))) = 0.75; sum 1.018941
    close(loss, 1.018941)
    close(metrics["kto/kl"], 0.25)
    close(metrics["kto/rewards_chosen"], 1.125)
    loss.backward()
    # every real token of a row gets the row's gradient: -0.098305 (desirable), +0.1875 (undesirable)
    close(logprobs.grad, [[-0.098305, -0.098305, 0.0], [0.1875, 0.1875, 0.0]])


def test_kto_loss_callable_reads_per_row_desirable_weights():
    # the rows above with a desirable_weight column: row 0 weighs 3 (not the scalar 1); row 1 is
    # undesirable and keeps w_u = 1.5: 3 * 0.268941 + 0.75 = 1.556823
    logprobs = T([[-1.5, -2.25, -9.0], [-3.0, -5.0, -99.0]])
    mb = Batch({"response_mask": T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]), "ref_logps": T([-6.0, -8.25]),
                "labels": T([1.0, 0.0]), "z_ref": T([0.25, 0.25]), "desirable_weight": T([3.0, 3.0])})
    loss, _ = KTOLoss(beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)(ForwardOutput(logprobs=logprobs), mb)
    close(loss, 1.556823)


def test_dpo_loss_callable_on_interleaved_pairs_is_twice_the_pair_sum():
    # rows [c0, r0, c1, r1], one token each: policy logps [-10, -15, -5, -5], reference [-12, -13, -5, -5]
    # pair 0: beta * ((-10 + 12) - (-15 + 13)) = 0.1 * 4 = 0.4 -> -logsigmoid(0.4) = 0.513015
    # pair 1: 0 -> ln 2 = 0.693147;  pair sum 1.206162; the callable returns 2x: 2.412324
    logprobs = T([[-10.0], [-15.0], [-5.0], [-5.0]])
    mb = Batch({"response_mask": torch.ones(4, 1), "ref_logps": T([-12.0, -13.0, -5.0, -5.0])})
    loss, metrics = DPOLoss(beta=0.1)(ForwardOutput(logprobs=logprobs), mb)
    close(loss, 2.412324)
    # the engine divides by 4 rows: 0.603081 = the mean over the 2 pairs
    close(loss / 4, 1.206162 / 2)
    close(metrics["dpo/reward_accuracy"], 0.5)
    close(metrics["dpo/reward_margin"], 0.2)


def test_pairwise_reward_loss_callable():
    # scores [c0, r0, c1, r1] = [2, 1, 0, 1]: c - r = [1, -1] -> 0.313262 + 1.313262 = 1.626524; x2
    loss, metrics = PairwiseRewardLoss()(ForwardOutput(scores=T([2.0, 1.0, 0.0, 1.0])), Batch())
    close(loss, 2 * 1.626524)
    close(metrics["rm/accuracy"], 0.5)


def test_pair_losses_reject_an_odd_micro_batch():
    with pytest.raises(ValueError, match="micro_batch_size even"):
        PairwiseRewardLoss()(ForwardOutput(scores=T([1.0, 2.0, 3.0])), Batch())


def test_pair_batch_interleaves_chosen_and_rejected():
    b = pair_batch([[1, 5], [1]], [[7, 2], [8, 2]], [[9, 2], [2]], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 5, 7, 2], [1, 5, 9, 2], [0, 1, 8, 2], [0, 1, 2, 0]]
    assert b["response_mask"].tolist() == [[1, 1], [1, 1], [1, 1], [1, 0]]


def ref_mismatch(groups):
    """The naive search: the smallest cyclic shift that pairs every row with another group."""
    b = len(groups)
    for k in range(1, b):
        if all(groups[(i + k) % b] != groups[i] for i in range(b)):
            return [(i + k) % b for i in range(b)]
    return [(i + 1) % b for i in range(b)]


@pytest.mark.parametrize("groups,want_shift", [
    ([0, 1, 2, 3], 1),              # offline: distinct prompts, the next row
    ([0, 0, 1, 1, 2, 2], 2),        # online, n = 2: the next prompt's first sample
    ([0, 0, 0, 1, 1, 1, 2, 2, 2], 3),
    ([5, 5, 5], 1),                 # one prompt only: no mismatch possible, shift 1
])
def test_mismatch_index(groups, want_shift):
    j = mismatch_index(T(groups))
    assert j.tolist() == [(i + want_shift) % len(groups) for i in range(len(groups))]
    assert j.tolist() == ref_mismatch(groups)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_mismatch_index_matches_reference_loop(seed):
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 4, (9,), generator=g).tolist()
    assert mismatch_index(T(groups)).tolist() == ref_mismatch(groups)


def test_unpack_sequences_inverts_build_sequences():
    prompts, responses = [[1, 4, 5], [1], [1, 9]], [[7, 2], [2], []]
    got = unpack_sequences(build_sequences(prompts, responses, pad_id=0))
    assert got == (prompts, responses)


def test_kto_reference_point_is_from_the_mismatched_rows():
    """The pieces of ``KTOPairs.step``: z_ref = max(0, mean(policy - ref)) over rows
    ``(x_i, y_j(i))``, computed by hand for an online batch of 2 prompts x 2 samples."""
    from xrlhf.algorithms.functional import kto_reference_point

    groups = T([0, 0, 1, 1])
    j = mismatch_index(groups)  # completions of the other prompt: [2, 3, 0, 1]
    assert j.tolist() == [2, 3, 0, 1]
    policy_kl = T([-4.0, -6.0, -5.0, -3.0])  # log pi(y_j(i) | x_i)
    ref_kl = T([-5.0, -5.0, -5.5, -4.5])     # log pi_ref(y_j(i) | x_i)
    # differences 1, -1, 0.5, 1.5 -> mean 0.5
    close(kto_reference_point(policy_kl, ref_kl), 0.5)
    assert math.isclose(float(kto_reference_point(ref_kl, policy_kl)), 0.0)  # mean -0.5 clamps to 0


def _policy_batch(seed: int = 0) -> tuple[Batch, torch.Tensor]:
    """Four rows with rollout logprobs near the policy's, staleness 0 / 1, and the policy's logprobs."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    logprobs = -torch.rand(4, 4, generator=g) * 3
    b = Batch({"response_mask": mask, "advantages": torch.randn(4, 4, generator=g),
               "rollout_logprobs": logprobs + 0.3 * torch.randn(4, 4, generator=g),
               "ref_logprobs": logprobs + 0.2 * torch.randn(4, 4, generator=g),
               "staleness": torch.tensor([[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0] * 4])})
    return b, logprobs


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_the_on_policy_loss_is_the_loss_with_old_logprobs_from_the_same_forward(correction):
    """``on_policy``: old = the forward's logprobs, detached: the same loss, gradient and TIS /
    off-policy weights as when they are given, and the mismatch the skipped forward's caller
    reported (mean, max, and by staleness as a sum and a count per token)."""
    from xrlhf.algorithms.losses import PolicyLoss
    from xrlhf.algorithms.off_policy import OffPolicy

    b, logprobs = _policy_batch()
    extra = {"tis_cap": 2.0} if correction == "tis" else {"off_policy": OffPolicy("mis", "token", 2.0, (0.5, 2.0))}
    given, own = (torch.nn.Parameter(logprobs.clone()) for _ in range(2))
    b_old = Batch({**{k: b[k] for k in b.keys()}, "old_logprobs": logprobs.clone()})
    loss = PolicyLoss(kl_coef=0.04, kl_estimator="k3", **extra)
    want, want_m = loss(ForwardOutput(logprobs=given), b_old)
    got, got_m = PolicyLoss(kl_coef=0.04, kl_estimator="k3", on_policy=True, staleness_bins=(0, 1), **extra)(
        ForwardOutput(logprobs=own), b)
    want.backward()
    got.backward()
    assert torch.equal(got, want) and torch.equal(own.grad, given.grad)
    for k, v in want_m.items():
        assert torch.equal(got_m[k], v), k
    assert float(got_m["policy/ratio_mean"]) == 1.0 and float(got_m["policy/clip_frac"]) == 0.0
    mask = b["response_mask"]
    diff = (logprobs - b["rollout_logprobs"]).abs() * mask
    close(got_m["mismatch/logprob_abs_diff_mean"], diff.sum() / mask.sum())
    close(got_m["mismatch/logprob_abs_diff_max"], diff.max())
    for d, rows in ((0, [0, 2]), (1, [1, 3])):
        close(got_m[f"mismatch/abs_diff_sum_s{d}"] / got_m[f"mismatch/tokens_s{d}"],
              diff[rows].sum() / mask[rows].sum())


def test_unit_weighted_means_take_the_largest_of_a_max():
    from xrlhf.engines.training import unit_weighted_means

    out = unit_weighted_means([(2.0, {"a": torch.tensor(1.0), "x_max": torch.tensor(3.0)}),
                               (6.0, {"a": 3.0, "x_max": 1.0})])
    assert out == {"a": 2.5, "x_max": 3.0}
