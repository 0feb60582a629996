"""The train template's bookkeeping: unit-weighted metrics, read from the device once per step."""

from __future__ import annotations

import pytest
import torch

from tests.engines.test_packing import rl_batch
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFTrainEngine
from xrlhf.engines.training import unit_weighted_means


def test_unit_weighted_means_by_hand():
    records = [(2.0, {"loss": torch.tensor(1.0), "clip": 0.5}),
               (6.0, {"loss": torch.tensor(3.0, dtype=torch.float64), "clip": torch.tensor(0.25)}),
               (0.0, {"loss": torch.tensor(100.0)})]
    got = unit_weighted_means(records)
    assert got == {"loss": (2 * 1 + 6 * 3) / 8, "clip": (2 * 0.5 + 6 * 0.25) / 8}
    assert unit_weighted_means([]) == {}
    assert unit_weighted_means([(0.0, {"x": torch.tensor(4.0)})]) == {"x": 0.0}  # no units: divided by 1


def test_float32_metrics_keep_the_per_micro_batch_loops_numbers():
    g = torch.Generator().manual_seed(0)
    records = [(float(w), {"m": torch.rand((), generator=g)}) for w in (3, 7, 11, 5)]
    want = sum(float(m["m"]) * w for w, m in records) / sum(w for w, _ in records)
    assert unit_weighted_means(records)["m"] == want  # bit for bit


class Probe:
    """A metric value that says when it is read."""

    def __init__(self, events: list[str]):
        self.events = events

    def __float__(self) -> float:
        self.events.append("read")
        return 1.0


def test_metrics_are_read_after_the_last_backward_was_queued(tiny_model, monkeypatch):
    """On a GPU every read of a device value waits for the device: a read per micro-batch would
    drain its queue between micro-batches. The template reads once, after the last backward."""
    events: list[str] = []
    engine = HFTrainEngine(EngineSpec(tiny_model, options={"micro_batch_size": 3, "lr": 1e-3}))
    backward = engine.backward
    monkeypatch.setattr(engine, "backward", lambda loss, last: (events.append("backward"), backward(loss, last)))
    monkeypatch.setattr(engine, "optimizer_step", lambda: events.append("optimizer") or {})
    loss = PolicyLoss()
    real = loss.__call__

    class Reading(PolicyLoss):
        def __call__(self, out, batch):
            loss_sum, metrics = real(out, batch)
            return loss_sum, {**metrics, "probe": Probe(events)}

    metrics = engine.train_step(rl_batch(9), Reading())
    assert metrics["micro_batches"] == 3 and metrics["probe"] == pytest.approx(1.0)
    assert events == ["backward"] * 3 + ["read"] * 3 + ["optimizer"]


def test_a_train_engines_forwards_without_gradients_take_their_own_budget(tiny_model):
    """Old logprobs keep no activations: ``infer_*`` sizes them apart from training; same numbers."""
    batch = rl_batch(12, seed=4)
    plain = HFTrainEngine(EngineSpec(tiny_model, options={"micro_batch_size": 3, "max_tokens_per_micro_batch": 20}))
    wide = HFTrainEngine(EngineSpec(tiny_model, options={"micro_batch_size": 3, "max_tokens_per_micro_batch": 20,
                                                         "infer_micro_batch_size": 12,
                                                         "infer_max_tokens_per_micro_batch": 400}))
    assert len(plain.micro_batches(batch, infer=True)) == len(plain.micro_batches(batch)) >= 4
    assert len(wide.micro_batches(batch, infer=True)) == 1 and len(wide.micro_batches(batch)) >= 4
    torch.testing.assert_close(wide.infer(batch)["logprobs"], plain.infer(batch)["logprobs"], atol=1e-6, rtol=1e-5)
    rows_only = HFTrainEngine(EngineSpec(tiny_model, options={"micro_batch_size": 3, "infer_micro_batch_size": 6}))
    assert [len(p) for _, p in rows_only.micro_batches(batch, infer=True)] == [6, 6]
