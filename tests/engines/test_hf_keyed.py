"""Keyed sampling of the Transformers generate engine (``generate(..., seeds=...)``) on CPU.

What is bit-exact and what is not (measured on the tiny Llama, CPU float32): a row's random
draws depend only on its seed, so its tokens are the same in any batch composition, order,
micro-batch size or thread; its logprobs are bit-exact across calls of the *same* composition
(and across threads, since each call's forward batches stay its own), but a row in another
batch (other rows, other padding, another micro-batch size, a row alone) goes through BLAS with
other blocking: about 1 logprob in 8 then differs by up to ~5e-7. So the tests ask for equal
tokens and logprobs within 1e-5 across compositions, bit-equality where the composition is the
same.
"""

from __future__ import annotations

import threading

import pytest
import torch

from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine
from xrlhf.engines.hf.decode import filter_top_k, filter_top_p, sample_next
from xrlhf.utils.seeds import derive_seed

PROMPTS = ["12+7=", "3?9=", "sort 3 1 2:", "parity 1011:", "a", "hello world", "7*8=", "x"]
SEEDS = [101 * i + 5 for i in range(len(PROMPTS))]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def prompts(tok):
    return [encode_prompt(tok, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def gen(tiny_model):
    return HFGenerateEngine(EngineSpec(tiny_model, seed=3))


def assert_rows_match(out, ref, rows, exact=False):
    """Rows ``rows`` of ``ref`` (in that order) equal ``out``: tokens always, logprobs within
    1e-5 (bit-equal when ``exact``)."""
    for j, i in enumerate(rows):
        assert out.token_ids[j] == ref.token_ids[i], f"row {i}"
        if exact:
            assert out.logprobs[j] == ref.logprobs[i], f"row {i}"
        else:
            torch.testing.assert_close(torch.tensor(out.logprobs[j]), torch.tensor(ref.logprobs[i]),
                                       atol=1e-5, rtol=0, msg=f"row {i}")


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_keyed_greedy_equals_unkeyed_greedy(gen, prompts, ignore_eos):
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=ignore_eos)
    plain = gen.generate(prompts, params)
    keyed = gen.generate(prompts, params, seeds=SEEDS)
    assert keyed.token_ids == plain.token_ids
    torch.testing.assert_close(torch.tensor(keyed.logprobs), torch.tensor(plain.logprobs), atol=1e-6, rtol=0)
    assert keyed.versions == [[0] * len(t) for t in keyed.token_ids]


def test_stop_tokens_end_rows_independently(gen, prompts):
    free = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True), seeds=SEEDS)
    stop = free.token_ids[0][2]  # row 0 ends at its third token (or earlier); others where they meet it
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[stop])
    out = gen.generate(prompts, params, seeds=SEEDS)
    for row, full in zip(out.token_ids, free.token_ids):
        expect = full[:full.index(stop) + 1] if stop in full else full
        assert row == expect
    assert len(out.token_ids[0]) <= 3 and len({len(t) for t in out.token_ids}) > 1
    assert out.token_ids == gen.generate(prompts, params).token_ids  # as the unkeyed path truncates
    ignored = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[stop],
                                                   ignore_eos=True), seeds=SEEDS)
    assert ignored.token_ids == free.token_ids


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=8),
                                    SAMPLED, SamplingParams(temperature=1.3, top_k=5, max_new_tokens=8)])
def test_keyed_logprobs_equal_recomputed(tiny_model, tok, gen, prompts, params):
    out = gen.generate(prompts, params, seeds=SEEDS)
    batch = build_sequences(prompts, out.token_ids, tok.pad_token_id, out.logprobs)
    recomputed = HFInferEngine(EngineSpec(tiny_model, temperature=params.temperature)).infer(batch)["logprobs"]
    torch.testing.assert_close(recomputed * batch["response_mask"], batch["rollout_logprobs"], atol=1e-5, rtol=0)


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_a_row_depends_only_on_its_seed_prompt_and_weights(gen, prompts):
    ref = gen.generate(prompts, SAMPLED, seeds=SEEDS)
    assert_rows_match(gen.generate(prompts, SAMPLED, seeds=SEEDS), ref, range(len(prompts)), exact=True)
    compositions = [list(range(len(prompts)))[::-1], [5, 1, 7], [2], [6, 0, 3, 4], [4, 4, 1]]
    for rows in compositions:
        for mbs in (1, 3, 256):
            gen.options.micro_batch_size = mbs
            try:
                out = gen.generate([prompts[i] for i in rows], SAMPLED, seeds=[SEEDS[i] for i in rows])
            finally:
                gen.options.micro_batch_size = 256
            assert_rows_match(out, ref, rows)
    other = gen.generate(prompts, SAMPLED, seeds=[s + 1 for s in SEEDS])
    assert other.token_ids != ref.token_ids  # the seed does matter
    same_seed = gen.generate([prompts[0]] * 4, SAMPLED, seeds=[SEEDS[0]] * 4)
    assert all(t == ref.token_ids[0] for t in same_seed.token_ids)


def test_concurrent_keyed_calls_match_their_calls_alone(tiny_model, prompts):
    gen = HFGenerateEngine(EngineSpec(tiny_model))
    parts = [[0, 1, 2], [3, 4], [5, 6, 7], [7, 0]]

    def call(rows):
        return gen.generate([prompts[i] for i in rows], SAMPLED, seeds=[SEEDS[i] for i in rows])

    alone = [call(rows) for rows in parts]
    plain_params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)
    plain_alone = HFGenerateEngine(EngineSpec(tiny_model)).generate(prompts, plain_params)
    results: dict[int, object] = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, call(parts[k])), daemon=True)
               for k in range(len(parts))]
    threads.append(threading.Thread(target=lambda: results.__setitem__("plain", gen.generate(prompts, plain_params)),
                                    daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for k, rows in enumerate(parts):
        assert_rows_match(results[k], alone[k], range(len(rows)), exact=True)
    # the unkeyed call owns the global RNG for its whole call: the keyed ones running meanwhile
    # change nothing (its seed is params.seed + the engine's call count, 0 on both engines)
    assert results["plain"].token_ids == plain_alone.token_ids
    assert results["plain"].logprobs == plain_alone.logprobs


def test_filters_equal_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    scores[0, :5] = scores[0, 5]  # ties at the k-th score are kept by both
    for k in (1, 5, 50, 80):
        assert torch.equal(filter_top_k(scores, k), TopKLogitsWarper(k)(None, scores))
    for p in (0.1, 0.5, 0.9, 0.999):
        assert torch.equal(filter_top_p(scores, p), TopPLogitsWarper(p)(None, scores))


def test_sample_next_draws_only_from_each_rows_generator():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.95)

    def gens():
        return [torch.Generator().manual_seed(s) for s in (1, 2, 3)]

    torch.manual_seed(0)
    a, lp = sample_next(logits, params, gens())
    torch.manual_seed(99)  # the global RNG is not used
    b, _ = sample_next(logits, params, gens())
    c, _ = sample_next(logits[[2, 0]], params, [gens()[2], gens()[0]])
    assert torch.equal(a, b) and torch.equal(c, a[[2, 0]])
    assert all(int(t) in torch.topk(row, 10).indices.tolist() for t, row in zip(a, logits))
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.7, -1).gather(-1, a[:, None])[:, 0])
    greedy, _ = sample_next(logits, SamplingParams(temperature=0), [])
    assert torch.equal(greedy, logits.argmax(-1))


def test_derive_seed():
    assert derive_seed(7, 0) == 7
    seeds = {derive_seed(s, a) for s in range(50) for a in range(1, 5)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(7, 2) == derive_seed(7, 2) != derive_seed(8, 2)
    torch.Generator().manual_seed(derive_seed(-3, 1))  # any int seed gives a valid generator seed


def test_one_seed_per_prompt(gen, prompts):
    with pytest.raises(ValueError, match="2 seeds for 8 prompts"):
        gen.generate(prompts, SAMPLED, seeds=[1, 2])
