"""The distillation divergences (``algorithms.divergence``) against hand-computed numbers, and
their per-token costs against the exact gradient of the full-vocabulary divergence."""

import math

import pytest
import torch

from xrlhf.algorithms import divergence as D
from xrlhf.algorithms.divergence import distill_advantages, divergence_estimate, split_by_correct, token_cost

LN = math.log


def lp(*probs):
    return torch.tensor([[LN(p) for p in probs]])


def test_reverse_kl_cost_and_estimate_by_hand():
    # student p = 0.5, 0.1; teacher q = 0.25, 0.4; the second token is padding
    p, q, mask = lp(0.5, 0.1), lp(0.25, 0.4), torch.tensor([[1.0, 0.0]])
    cost = token_cost(p, q, mask)
    assert cost.tolist()[0] == pytest.approx([LN(2), 0.0])
    assert divergence_estimate(p, q, mask).tolist()[0] == pytest.approx([0.693147, 0.0], abs=1e-6)


def test_jsd_cost_and_estimate_by_hand():
    # p = 0.5, q = 0.25, beta 0.5: m = 0.375, c = 0.5 ln(0.5/0.375) = 0.143841,
    # estimate = c + 0.5 * (0.25/0.5) * ln(0.25/0.375) = 0.143841 - 0.101366 = 0.042475
    p, q, mask = lp(0.5), lp(0.25), torch.ones(1, 1)
    assert float(token_cost(p, q, mask, "jsd", 0.5)) == pytest.approx(0.143841, abs=1e-6)
    assert float(divergence_estimate(p, q, mask, "jsd", 0.5)) == pytest.approx(0.042475, abs=1e-6)
    # beta 0.9: m = 0.9 * 0.25 + 0.1 * 0.5 = 0.275, c = 0.1 ln(0.5/0.275) = 0.059784
    assert float(token_cost(p, q, mask, "jsd", 0.9)) == pytest.approx(0.059784, abs=1e-6)
    with pytest.raises(ValueError, match="beta"):
        token_cost(p, q, mask, "jsd", 1.0)


def test_equal_models_cost_nothing():
    x = torch.log_softmax(torch.randn(3, 5), -1)
    for div in ("reverse_kl", "jsd"):
        assert torch.allclose(token_cost(x, x, torch.ones(3, 5), div), torch.zeros(3, 5), atol=1e-6)
        assert torch.allclose(divergence_estimate(x, x, torch.ones(3, 5), div), torch.zeros(3, 5), atol=1e-6)


def full_divergence(logits, q, divergence, beta):
    p = torch.softmax(logits, -1)
    if divergence == "reverse_kl":
        return (p * (p.log() - q.log())).sum()
    m = beta * q + (1 - beta) * p
    return beta * (q * (q.log() - m.log())).sum() + (1 - beta) * (p * (p.log() - m.log())).sum()


@pytest.mark.parametrize("divergence,beta", [("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)])
def test_cost_is_the_exact_policy_gradient_and_the_estimate_is_unbiased(divergence, beta):
    """sum_y p(y) c(y) grad log p(y) == grad D(p, q), summed over the whole vocabulary; and the
    estimate's mean under p is D."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    d = full_divergence(logits, q, divergence, beta)
    (want,) = torch.autograd.grad(d, logits)

    log_p = torch.log_softmax(logits, -1)
    ones = torch.ones(1, 7, dtype=torch.float64)
    cost = token_cost(log_p.detach()[None], q.log()[None], ones, divergence, beta)[0]
    surrogate = (log_p.exp().detach() * cost * log_p).sum()  # E_p[c * log p], c held fixed
    (got,) = torch.autograd.grad(surrogate, logits)
    assert torch.allclose(got, want, atol=1e-10)

    est = divergence_estimate(log_p.detach()[None], q.log()[None], ones, divergence, beta)[0]
    assert float((log_p.exp().detach() * est).sum()) == pytest.approx(float(d.detach()), abs=1e-10)


def test_distill_advantages_adds_the_weighted_task_advantage():
    cost = torch.tensor([[0.5, -0.25, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert distill_advantages(cost, mask).tolist() == [[-0.5, 0.25, 0.0]]
    task = torch.tensor([[1.0, 1.0, 1.0]])
    assert distill_advantages(cost, mask, task, 0.5).tolist() == [[0.0, 0.75, 0.0]]
    with pytest.raises(ValueError, match="task_advantages"):
        distill_advantages(cost, mask, None, 0.5)


def test_split_by_correct_token_means():
    per_token = torch.tensor([[1.0, 3.0], [10.0, 0.0], [4.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    out = split_by_correct(per_token, mask, torch.tensor([True, False, True]))
    assert out == pytest.approx({"mean": 22 / 5, "right": 12 / 4, "wrong": 10.0})
    assert "wrong" not in split_by_correct(per_token, mask, torch.tensor([True, True, True]))


def test_topk_reverse_kl_by_hand():
    # a 3-token vocabulary, top-2 of the teacher: {0, 1}; student p = (0.5, 0.3, 0.2), teacher q = (0.6, 0.3, 0.1)
    s = torch.tensor([[[math.log(0.5), math.log(0.3)]]])
    t = torch.tensor([[[math.log(0.6), math.log(0.3)]]])
    want = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(1.0) + 0.2 * math.log(0.2 / 0.1)
    got = D.topk_reverse_kl(s, t, torch.ones(1, 1))
    assert got.item() == pytest.approx(want, rel=1e-6)
    assert D.topk_reverse_kl(s, t, torch.zeros(1, 1)).item() == 0.0


def test_topk_reverse_kl_is_the_full_kl_at_k_equal_v_and_a_lower_bound_below():
    torch.manual_seed(0)
    logp, logq = torch.log_softmax(torch.randn(2, 3, 8), -1), torch.log_softmax(torch.randn(2, 3, 8), -1)
    full = (logp.exp() * (logp - logq)).sum(-1)
    mask = torch.ones(2, 3)
    torch.testing.assert_close(D.topk_reverse_kl(logp, logq, mask), full, atol=1e-5, rtol=1e-5)
    top = torch.topk(logq, 3, -1).indices
    part = D.topk_reverse_kl(torch.gather(logp, -1, top), torch.gather(logq, -1, top), mask)
    assert (part <= full + 1e-6).all() and (part >= -1e-6).all()


def test_topk_reverse_kl_gradient_is_the_full_kls_at_k_equal_v_and_finite():
    torch.manual_seed(1)
    z = torch.randn(1, 2, 6, requires_grad=True)
    logq = torch.log_softmax(torch.randn(1, 2, 6), -1)
    D.topk_reverse_kl(torch.log_softmax(z, -1), logq, torch.ones(1, 2)).sum().backward()
    got = z.grad.clone()
    z.grad = None
    logp = torch.log_softmax(z, -1)
    (logp.exp() * (logp - logq)).sum().backward()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, z.grad, atol=1e-5, rtol=1e-4)
