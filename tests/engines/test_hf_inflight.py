"""In-flight weight updates of the Transformers generate engine (``pauses_mid_generation``).

A sync lands at a known token: the engine's ``step_hook`` runs before each token step, outside
the gate, and the tests run the sync there (same thread), or release a sync in the main thread
from there with events (cross-thread), never with sleeps. Two weight sets are kept (the tiny
model's, and the same plus noise) so every token's logprob can be recomputed under the weights
of the version it is stamped with.
"""

from __future__ import annotations

import threading

import pytest
import torch

from xrlhf.data.batch import build_sequences
from xrlhf.data.text import encode_prompt, load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine, load_named_weights
from xrlhf.utils.seeds import derive_seed
from xrlhf.weight_sync import WeightSyncError, build_transport, push_weights

PROMPTS = ["12+7=", "3?9=", "sort 3 1 2:", "parity 1011:", "hello"]
SEEDS = [7 * i + 1 for i in range(len(PROMPTS))]
AT = 4  # the sync lands before the 5th token
N = 9


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def prompts(tok):
    return [encode_prompt(tok, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def weights(tiny_model):
    """Version 0 (the checkpoint's) and version 1 (the same plus noise)."""
    w0 = {n: t.clone() for n, t in HFGenerateEngine(EngineSpec(tiny_model)).model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    w1 = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in w0.items()}
    return {0: w0, 1: w1}


@pytest.fixture()
def gen(tiny_model):
    return HFGenerateEngine(EngineSpec(tiny_model))


def sync(gen, weights, version, bucket_bytes=16 << 10):
    """A whole sync as ``EngineHost.sync_weights_local`` runs it: buckets, then ``end_sync``."""
    transport = build_transport("in_process", bucket_bytes=bucket_bytes)
    n = push_weights(transport, weights.items(), gen.receive_weights)
    gen.end_sync(version)
    return n


def land_at(gen, step, weights, version):
    """Run a sync before token ``step`` of the first attempt (once; an abort restarts at 0)."""
    done = []

    def hook(s):
        if s == step and not done:
            done.append(True)
            sync(gen, weights, version)

    gen.step_hook = hook


def recomputed(tiny_model, tok, prompts, out, weights, temperature):
    """``[B, R]`` logprobs of ``out``'s tokens recomputed by ``HFModel.forward`` under ``weights``."""
    infer = HFInferEngine(EngineSpec(tiny_model, temperature=temperature))
    load_named_weights(infer.hf.model, weights.items())
    return infer.infer(build_sequences(prompts, out.token_ids, tok.pad_token_id))["logprobs"]


def assert_stamped_logprobs(tiny_model, tok, prompts, out, weights, temperature=1.0):
    """Every token's logprob equals its recomputation under the weights of its stamped version."""
    by_version = {v: recomputed(tiny_model, tok, prompts, out, w, temperature) for v, w in weights.items()}
    for i, (lps, vs) in enumerate(zip(out.logprobs, out.versions)):
        for j, (lp, v) in enumerate(zip(lps, vs)):
            assert lp == pytest.approx(float(by_version[v][i, j]), abs=1e-5), f"row {i} token {j} (version {v})"


def assert_monotone(out):
    assert all(vs == sorted(vs) for vs in out.versions)


def test_recompute_every_token_matches_its_version(tiny_model, tok, prompts, weights, gen):
    land_at(gen, AT, weights[1], 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True, on_update="recompute")
    out = gen.generate(prompts, params, seeds=SEEDS)
    assert out.versions == [[0] * AT + [1] * (N - AT)] * len(prompts)
    assert gen.version == 1
    assert_stamped_logprobs(tiny_model, tok, prompts, out, weights)
    # meaningful: the tokens after the update are not what version 0 would give them
    old = recomputed(tiny_model, tok, prompts, out, weights[0], 1.0)[:, AT:]
    assert (old - torch.tensor(out.logprobs)[:, AT:]).abs().max() > 1e-2


def test_continue_keeps_the_cache_and_stamps_the_new_version(tiny_model, tok, prompts, weights, gen):
    land_at(gen, AT, weights[1], 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True, on_update="continue")
    out = gen.generate(prompts, params, seeds=SEEDS)
    assert_monotone(out)
    assert out.versions == [[0] * AT + [1] * (N - AT)] * len(prompts)
    new = recomputed(tiny_model, tok, prompts, out, weights[1], 1.0)
    old = recomputed(tiny_model, tok, prompts, out, weights[0], 1.0)
    got = torch.tensor(out.logprobs)
    torch.testing.assert_close(got[:, :AT], old[:, :AT], atol=1e-5, rtol=0)  # before the update: version 0
    # after it, the KV cache of the old weights is kept: neither weight set alone gives these logprobs
    assert (got[:, AT:] - new[:, AT:]).abs().max() > 1e-4 and (got[:, AT:] - old[:, AT:]).abs().max() > 1e-4


def test_abort_restarts_unfinished_rows_with_derived_seeds(tiny_model, tok, prompts, weights, gen):
    free = gen.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True), seeds=SEEDS)
    stop = free.token_ids[0][1]  # row 0 (and maybe others) ends before the update lands
    params = SamplingParams(temperature=1.0, max_new_tokens=N, stop_token_ids=[stop], on_update="abort")
    before = gen.generate(prompts, params, seeds=SEEDS)
    done_early = [i for i, t in enumerate(before.token_ids) if len(t) <= AT]
    assert 0 in done_early and len(done_early) < len(prompts)
    land_at(gen, AT, weights[1], 1)
    out = gen.generate(prompts, params, seeds=SEEDS)
    assert all(len(set(vs)) == 1 for vs in out.versions)  # one version per row
    assert_stamped_logprobs(tiny_model, tok, prompts, out, weights)
    gen.step_hook = None
    restarted = gen.generate(prompts, params, seeds=[derive_seed(s, 1) for s in SEEDS])  # under version 1
    for i in range(len(prompts)):
        if i in done_early:
            assert out.token_ids[i] == before.token_ids[i] and out.versions[i][0] == 0
        else:
            assert out.token_ids[i] == restarted.token_ids[i] and out.versions[i][0] == 1


def test_sync_with_no_generation_running(tiny_model, prompts, weights, gen):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    assert sync(gen, weights[1], 1) == len(weights[1])
    out = gen.generate(prompts, params, seeds=SEEDS)
    assert sync(gen, weights[1], 2) == len(weights[1])  # another one: nothing left paused
    plain = gen.generate(prompts, params)
    assert all(v == [1] * 6 for v in out.versions) and all(v == [2] * 6 for v in plain.versions)
    fresh = HFGenerateEngine(EngineSpec(tiny_model))
    fresh.update_weights(weights[1].items())
    assert fresh.generate(prompts, params, seeds=SEEDS).token_ids == out.token_ids
    assert gen.weight_checksums() == fresh.weight_checksums()


def test_a_failed_sync_releases_the_pause(prompts, weights, gen):
    transport = build_transport("in_process", bucket_bytes=16 << 10, verify=True)
    messages = list(transport.send({n: t.clone() for n, t in weights[1].items()}.items()))
    messages[1].payload[0].view(torch.uint8).view(-1)[0] ^= 1  # a bit flipped in transit
    gen.receive_weights(transport, messages[:1])
    assert gen.gate.paused
    with pytest.raises(WeightSyncError):
        gen.receive_weights(transport, messages[1:2])
    assert not gen.gate.paused and gen.version == 0  # so this generate does not hang:
    out = gen.generate(prompts, SamplingParams(max_new_tokens=3), seeds=SEEDS)
    assert all(v == [0] * len(v) for v in out.versions)


def test_sync_from_another_thread_mid_generation(tiny_model, tok, prompts, weights, gen):
    """The generating thread reaches token ``AT`` and lets the main thread start a sync; the
    first bucket pauses it (the main thread sees its step held before loading the other
    buckets), so token ``AT`` is sampled after ``end_sync``, by whole new weights, never by the
    half-loaded ones in between."""
    reached, paused = threading.Event(), threading.Event()

    def hook(step):
        if step == AT and not reached.is_set():
            reached.set()
            assert paused.wait(timeout=120)

    gen.step_hook = hook
    params = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True, on_update="recompute")
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", gen.generate(prompts, params, seeds=SEEDS)),
                              daemon=True)
    worker.start()
    assert reached.wait(timeout=120)
    transport = build_transport("in_process", bucket_bytes=4 << 10)
    messages = list(transport.send(weights[1].items()))
    assert len(messages) > 2
    for k, m in enumerate(messages):
        gen.receive_weights(transport, [m])
        if k == 0:
            paused.set()
            assert gen.gate.wait_held(1, timeout=120)  # token AT waits for the rest of the sync
    gen.end_sync(1)
    worker.join(timeout=300)
    out = result["out"]
    assert out.versions == [[0] * AT + [1] * (N - AT)] * len(prompts)
    assert_stamped_logprobs(tiny_model, tok, prompts, out, weights)


def test_plain_call_during_an_in_flight_update_sees_one_weight_set(tiny_model, prompts, weights, gen):
    """An unkeyed call started from another thread while a keyed call runs and syncs: it holds
    the gate for its whole call, so it runs entirely under version 0 or entirely under 1."""
    plain_params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    refs = {}
    for v in (0, 1):
        ref = HFGenerateEngine(EngineSpec(tiny_model))
        ref.update_weights(weights[v].items())
        refs[v] = ref.generate(prompts, plain_params)
    result, threads = {}, []

    def hook(step):
        if step == 2 and not threads:
            plain = lambda: result.setdefault("plain", gen.generate(prompts, plain_params))  # noqa: E731
            threads.append(threading.Thread(target=plain, daemon=True))
            threads[0].start()
        if step == AT and "synced" not in result:
            result["synced"] = sync(gen, weights[1], 1)

    gen.step_hook = hook
    params = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True, on_update="recompute")
    out = gen.generate(prompts, params, seeds=SEEDS)
    threads[0].join(timeout=300)
    assert_monotone(out)
    plain = result["plain"]
    v = plain.versions[0][0]
    assert all(vs == [v] * len(vs) for vs in plain.versions)
    assert plain.token_ids == refs[v].token_ids and plain.logprobs == refs[v].logprobs
