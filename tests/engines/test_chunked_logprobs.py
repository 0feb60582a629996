"""Logprobs and entropy from hidden states, chunk by chunk, without full-vocabulary logits."""

from __future__ import annotations

import math

import pytest
import torch

from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.utils.tensors import chunked_token_logprobs, entropy_from_logits


def full(hidden, weight, targets, temperature=1.0, need_entropy=True):
    """Today's computation on the whole ``[N, V]`` logits: the reference."""
    z = (hidden @ weight.T).float() / temperature
    lp = torch.gather(torch.log_softmax(z, -1), -1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, entropy_from_logits(z) if need_entropy else None


def test_hand_computed_numbers():
    # head = identity on 2 features, vocabulary of 2: logits are the hidden state itself
    hidden = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    targets = torch.tensor([1, 0])
    lp, ent = chunked_token_logprobs(hidden, lambda h: h, targets, chunk=1, need_entropy=True)
    # row 0: uniform over 2 -> log 1/2, entropy log 2; row 1: p = (3/4, 1/4) -> log 3/4,
    # entropy -(3/4 log 3/4 + 1/4 log 1/4)
    torch.testing.assert_close(lp, torch.tensor([math.log(0.5), math.log(0.75)]))
    torch.testing.assert_close(ent, torch.tensor([math.log(2.0), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]))
    # temperature 2 halves the logits: p = (sqrt3, 1) / (sqrt3 + 1)
    lp2, _ = chunked_token_logprobs(hidden, lambda h: h, targets, temperature=2.0, chunk=1)
    torch.testing.assert_close(lp2[1], torch.tensor(math.log(math.sqrt(3) / (math.sqrt(3) + 1))))


@pytest.mark.parametrize("chunk", [1, 7, 100, 0])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_equals_full_logits_values_and_gradients(chunk, temperature):
    torch.manual_seed(0)
    n, h, v = 23, 16, 50
    hidden = torch.randn(n, h, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(v, h).requires_grad_()
    targets = torch.randint(0, v, (n,))
    head = lambda x: x @ weight.T  # noqa: E731
    lp, ent = chunked_token_logprobs(hidden, head, targets, temperature, chunk, need_entropy=True)
    want_lp, want_ent = full(hidden, weight, targets, temperature)
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=1e-6)
    coef = torch.randn(n)
    grads = torch.autograd.grad((lp * coef).sum() + 0.3 * ent.sum(), (hidden, weight))
    want = torch.autograd.grad((want_lp * coef).sum() + 0.3 * want_ent.sum(), (hidden, weight))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_bfloat16_head_matches_within_bf16_rounding():
    torch.manual_seed(1)
    hidden = torch.randn(40, 32).bfloat16().requires_grad_()
    weight = (torch.randn(300, 32) * 0.2).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (40,))
    head = lambda x: x @ weight.T  # noqa: E731
    lp, ent = chunked_token_logprobs(hidden, head, targets, chunk=8, need_entropy=True)
    want_lp, want_ent = full(hidden, weight, targets)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)  # same bf16 matmul per row, fp32 after
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    g = torch.autograd.grad(lp.sum(), weight)[0].float()
    w = torch.autograd.grad(want_lp.sum(), weight)[0].float()
    assert (g - w).norm() / w.norm() < 1e-2  # bf16 gradients, summed per chunk


def test_the_graph_keeps_no_full_vocabulary_tensor():
    """Every tensor autograd saves for the backward, outside the checkpointed chunks, is at most
    ``[N, H]`` or ``[chunk, V]``; without chunking the ``[N, V]`` logits are saved."""
    n, h, v, chunk = 64, 8, 1000, 16
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    head = lambda x: x @ weight.T  # noqa: E731

    def largest_saved(chunk_size):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = chunked_token_logprobs(hidden, head, targets, chunk=chunk_size, need_entropy=True)
        (lp.sum() + ent.sum()).backward()
        return max(sizes)

    assert largest_saved(chunk) <= max(chunk * v, v * h)  # the weight itself is [V, H]
    assert largest_saved(0) >= n * v


def test_policy_loss_needs_entropy_only_for_the_bonus_or_the_metric():
    assert not PolicyLoss().needs_entropy
    assert PolicyLoss(entropy_coef=0.01).needs_entropy
    assert PolicyLoss(log_entropy=True).needs_entropy


PEAK = """
import resource, sys, torch
from xrlhf.utils.tensors import chunked_token_logprobs
torch.manual_seed(0)
n, h, v = 2048, 64, 32000
hidden = torch.randn(n, h, requires_grad=True)
weight = (torch.randn(v, h) * 0.05).requires_grad_()
targets = torch.randint(0, v, (n,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
lp, ent = chunked_token_logprobs(hidden, lambda x: x @ weight.T, targets, chunk=int(sys.argv[1]), need_entropy=True)
(lp.sum() + ent.sum()).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def peak_mib(chunk: int) -> float:
    """Growth of the peak resident memory of a fresh process over a forward + backward of 2048
    tokens, vocabulary 32000 (one fp32 ``[2048, 32000]`` tensor is 250 MiB). glibc's malloc
    would serve freed 30 MiB blocks from a heap that fragments (its mmap threshold grows with
    the first free), which measures the allocator; a fixed threshold measures the tensors."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", PEAK, str(chunk)], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess per chunk size, measuring peaks
def test_peak_memory_is_one_chunk_not_the_whole_vocabulary():
    full_mib, chunked_mib = peak_mib(0), peak_mib(256)
    print(f"peak growth: full logits {full_mib:.0f} MiB, chunks of 256 tokens {chunked_mib:.0f} MiB")
    # logits, log-softmax, the entropy's temporaries and their gradients, 250 MiB each: at least four
    # alive at once (measured 1490-2070 MiB across machines, the allocator decides how many linger)
    assert full_mib > 1000
    assert chunked_mib < full_mib / 4  # measured: ~0-345 MiB


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
@pytest.mark.slow  # torch.compile of the chunk (and its backward): tens of seconds
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_compiled_chunks_give_the_eager_values_and_gradients(temperature):
    """The GPU's path (``compiled=True``, one torch.compile'd chunk) against the eager chunks,
    under activation checkpointing (the backward recomputes the compiled chunk); chunk lengths
    23 % 8 = 7 and 8 both run, as a micro-batch's last, shorter chunk does."""
    from xrlhf.utils.tensors import chunked_head_columns

    torch.manual_seed(2)
    n, h, v = 23, 16, 50
    hidden = torch.randn(n, h).requires_grad_()
    weight = torch.randn(v, h).requires_grad_()
    targets = torch.randint(0, v, (n, 2))
    head = lambda x: x @ weight.T  # noqa: E731
    coef = torch.randn(n, 3)
    got, want = ([chunked_head_columns(hidden, head, targets, temperature, 8, need_entropy=True, compiled=c)
                  for c in (True, False)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad((got * coef).sum(), (hidden, weight))
    wants = torch.autograd.grad((want * coef).sum(), (hidden, weight))
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the infer path: no checkpoint, top-k columns too
        got = chunked_head_columns(hidden, head, targets, temperature, 8, topk=3, compiled=True)
        want = chunked_head_columns(hidden, head, targets, temperature, 8, topk=3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
