"""Data-parallel dispatch: any batch splits over any number of ranks, padding is dropped on the
way back, metrics are weighted by units, and padded train rows weigh nothing; the trainers'
seam (``Handles``) is met by the Ray coordinator and by the in-process handles alike
(tests/coordinator/test_handles_seam.py runs one table of calls on both)."""

from __future__ import annotations

import pytest
import torch

from xrlhf.engines.handles import Handle, Handles
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.algorithms.losses import KTOLoss, PolicyLoss
from xrlhf.data.batch import Batch, build_sequences
from xrlhf.data.dispatch import ALL, DP, DP_TRAIN, RANK0, gather, gather_metrics, plan, split, split_train
from xrlhf.engines.base import EngineSpec, GenerationOutput, SamplingParams
from xrlhf.engines.training import global_units
from xrlhf.engines.hf import HFGenerateEngine, HFTrainEngine


def numbered(n: int) -> Batch:
    return Batch({"x": torch.arange(n), "response_mask": torch.ones(n, 3)})


def test_even_split_is_the_old_equal_consecutive_split():
    s = split(numbered(8), 2)
    assert [p["x"].tolist() for p in s.parts] == [[0, 1, 2, 3], [4, 5, 6, 7]] and s.real == [4, 4]
    assert not s.padded
    assert split(list("abcdef"), 3).parts == [["a", "b"], ["c", "d"], ["e", "f"]]


def test_uneven_split_pads_with_copies_and_gather_drops_them():
    s = split(numbered(5), 2)
    assert [p["x"].tolist() for p in s.parts] == [[0, 1, 2], [3, 4, 3]] and s.real == [3, 2]
    assert gather(s.parts, s.real)["x"].tolist() == [0, 1, 2, 3, 4]
    s = split(list("abc"), 4)  # fewer rows than ranks: an empty part gets a copy of row 0
    assert s.parts == [["a"], ["b"], ["c"], ["a"]] and s.real == [1, 1, 1, 0]
    assert gather(s.parts, s.real) == ["a", "b", "c"]
    out = gather([GenerationOutput([[1], [2]], [[0.1], [0.2]]), GenerationOutput([[3], [1]], [[0.3], [0.1]])], [2, 1])
    assert out == GenerationOutput([[1], [2], [3]], [[0.1], [0.2], [0.3]])
    with pytest.raises(TypeError, match="cannot split a dict"):
        split({"a": 1}, 2)


def test_train_split_zeroes_the_padding_rows_mask_and_refuses_uneven_sequence_losses():
    s = split_train(numbered(5), 2, "token")
    assert s.parts[1]["response_mask"].sum(-1).tolist() == [3.0, 3.0, 0.0]
    assert s.parts[0]["response_mask"].sum() == 9  # real rows untouched
    assert "row_weight" not in split_train(numbered(6), 2, "sequence").parts[0]  # even: as before
    with pytest.raises(ValueError, match="sequence-unit loss needs a batch whose rows divide by the handle's ranks"):
        split_train(numbered(5), 2, "sequence")  # pairs (DPO, reward model) would be cut
    s = split_train(numbered(5), 2, "sequence", row_weighted=True)
    assert [p["row_weight"].tolist() for p in s.parts] == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_metrics_are_weighted_by_units():
    assert gather_metrics([{"loss": 1.0, "lr": 0.1}, {"loss": 4.0, "lr": 0.1}], [3, 1]) == \
        pytest.approx({"loss": 1.75, "lr": 0.1})
    assert gather_metrics([{"loss": 1.0}, {"loss": 9.0}], [2, 0]) == {"loss": 1.0}  # all-padding rank left out
    # the plan weighs each rank by the real tokens of the part it sent
    batch = build_sequences([[1]] * 3, [[5, 6], [5], [5, 6, 7]], 0)
    ranks, calls, combine = plan(DP_TRAIN, 2, (batch, PolicyLoss()), {})
    assert ranks == [0, 1] and [len(a[0]) for a, _ in calls] == [2, 2]
    assert combine([{"m": 1.0}, {"m": 2.0}]) == pytest.approx({"m": (3 * 1.0 + 3 * 2.0) / 6})
    assert plan(ALL, 3, ("p",), {})[0] == [0, 1, 2] and plan(RANK0, 3, ("p",), {})[0] == [0]
    assert plan(DP, 2, ([1, 2, 3], "params"), {})[1][1] == (([3, 3], "params"), {})


def rl_batch(n: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    batch = build_sequences([[1, 5 + i] for i in range(n)], [[7 + i % 3] * (1 + i % 3) + [2] for i in range(n)], 0)
    mask = batch["response_mask"]
    batch["old_logprobs"] = -torch.rand(mask.shape, generator=g) * mask
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    return batch


def grads_of(engine: HFTrainEngine, parts: list[Batch], loss_fn) -> dict[str, torch.Tensor]:
    """The gradient ``R`` data-parallel ranks sum (all-reduce), computed rank by rank here:
    each part's loss sum over the global unit count, as ``TrainEngine.train_step`` does."""
    engine.model.zero_grad()
    denom = sum(global_units(p, loss_fn.unit, torch.device("cpu")) for p in parts)
    for part in parts:
        loss_sum, _ = loss_fn(engine.forward(part, need_entropy=loss_fn.needs_entropy), part)
        (loss_sum / denom).backward()
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def test_padded_train_rows_contribute_nothing(tiny_model):
    engine = HFTrainEngine(EngineSpec(model_path=tiny_model, options={"lr": 1e-3}, seed=0))
    batch, loss = rl_batch(5), PolicyLoss(clip_eps=0.2, entropy_coef=0.01)
    one = grads_of(engine, [batch], loss)
    s = split_train(batch, 2, loss.unit)
    assert s.padded
    two = grads_of(engine, s.parts, loss)
    assert max(float(g.abs().max()) for g in one.values()) > 0
    for k in one:
        torch.testing.assert_close(one[k], two[k], atol=1e-6, rtol=1e-5, msg=k)
    assert LocalHandle.of("policy", train=engine).train_step(batch, loss)["grad_norm"] > 0


def test_padded_kto_rows_contribute_nothing(tiny_model):
    """Online KTO trains on any number of rows: 2 ranks on 5 rows step as 1 rank on 5 (the copy
    the split adds has row_weight 0, which the engines count and KTO's loss leaves out)."""
    engine = HFTrainEngine(EngineSpec(model_path=tiny_model, options={"lr": 1e-3}, seed=0))
    batch = rl_batch(5)
    batch["ref_logps"] = torch.tensor([-3.0, -2.5, -4.0, -1.0, -2.0])
    batch["labels"] = torch.tensor([1, 0, 1, 1, 0])
    batch["z_ref"] = torch.full((5,), 0.1)
    batch["desirable_weight"] = torch.tensor([1.0, 1.3, 1.3, 0.7, 1.0])
    loss = KTOLoss(beta=0.5)
    one = grads_of(engine, [batch], loss)
    s = split_train(batch, 2, loss.unit, loss.row_weighted)
    assert s.padded and s.parts[1]["row_weight"].tolist() == [1.0, 1.0, 0.0]
    two = grads_of(engine, s.parts, loss)
    assert max(float(g.abs().max()) for g in one.values()) > 0
    for k in one:
        torch.testing.assert_close(one[k], two[k], atol=1e-6, rtol=1e-5, msg=k)
    _, stats = loss(engine.forward(s.parts[1]), s.parts[1])  # metrics of the real rows only
    _, want = loss(engine.forward(batch.index(slice(3, 5))), batch.index(slice(3, 5)))
    assert float(stats["kto/rewards_chosen"]) == pytest.approx(float(want["kto/rewards_chosen"]))


def test_coordinator_and_local_handles_satisfy_the_seam(tiny_model):
    from xrlhf.coordinator import Coordinator, ModelHandle

    for cls in (Coordinator, LocalHandles):  # the run's models: one base, nothing left abstract
        assert issubclass(cls, Handles) and not getattr(cls, "__abstractmethods__", None), cls.__name__
    for cls in (ModelHandle, LocalHandle):  # both run the calls declared once, each with its dispatch
        assert issubclass(cls, Handle) and not getattr(cls, "__abstractmethods__", None)
        declared = {n for n, f in vars(Handle).items() if hasattr(f, "dispatch_mode")}
        assert {"generate", "infer", "train_step", "receive_each", "end_sync"} <= declared
        assert all(getattr(cls, n) is getattr(Handle, n) for n in declared - {"sync_weights_local"})
    spec = EngineSpec(model_path=tiny_model, options={"lr": 1e-3}, seed=0)
    gen_spec = EngineSpec(model_path=tiny_model, seed=0)  # each engine validates its own options
    local = LocalHandles(LocalHandle.of("policy", train=HFTrainEngine(spec), generate=HFGenerateEngine(gen_spec)))
    assert isinstance(local, Handles) and isinstance(local.policy, Handle)
    assert local.generator is local.policy and local.critic is None and local.reward is None
    assert local.sync_weights() >= 0.0
    prompts, greedy = [[1, 5], [1, 6], [1, 7]], SamplingParams(max_new_tokens=2, temperature=0)
    want = local.generator.generate(prompts, greedy)
    two = LocalHandle("rollout", [LocalHandle.of("rollout", generate=HFGenerateEngine(gen_spec)).hosts[0]
                                  for _ in range(2)])  # 2 in-process ranks: 3 prompts split 2 + (1 + a copy)
    assert two.generate(prompts, greedy) == want and len(want.token_ids) == 3


def test_a_maximum_over_ranks_is_the_largest_not_the_mean():
    from xrlhf.data.dispatch import gather_metrics

    got = gather_metrics([{"loss": 1.0, "mismatch/logprob_abs_diff_max": 0.5},
                          {"loss": 3.0, "mismatch/logprob_abs_diff_max": 2.0}], [1.0, 3.0])
    assert got == {"loss": 2.5, "mismatch/logprob_abs_diff_max": 2.0}
