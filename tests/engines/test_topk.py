"""Top-k for distillation (issue 27): the logprob head gathers several ids per position and returns
each position's top-k, chunked or not; the engines return a teacher's top-k (``topk_logprobs``) and
a student's logprobs at given ids (``gather``), packed and padded alike, with gradients."""

from __future__ import annotations

import pytest
import torch

from tests.engines.test_packing import rl_batch
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFInferEngine, HFTrainEngine
from xrlhf.engines.hf.packing import pack_rows, pad_rows
from xrlhf.utils.tensors import chunked_head_columns


def test_head_columns_gather_several_ids_and_the_topk_chunk_by_chunk():
    torch.manual_seed(0)
    hidden, weight = torch.randn(10, 6), torch.randn(11, 6)
    head = lambda h: h @ weight.T  # noqa: E731
    ids = torch.randint(0, 11, (10, 3))
    logp = torch.log_softmax(head(hidden) / 0.7, -1)
    for chunk in (0, 3, 100):
        cols = chunked_head_columns(hidden, head, ids, 0.7, chunk, need_entropy=True, topk=4)
        assert cols.shape == (10, 3 + 1 + 8)
        torch.testing.assert_close(cols[:, :3], torch.gather(logp, -1, ids))
        values, top = torch.topk(logp, 4, -1)
        torch.testing.assert_close(cols[:, 4:8], values)
        assert torch.equal(cols[:, 8:].long(), top)


def test_gathered_columns_carry_the_full_gradient_under_recomputation():
    torch.manual_seed(1)
    hidden, weight = torch.randn(9, 5, requires_grad=True), torch.randn(7, 5)
    ids = torch.randint(0, 7, (9, 2))
    chunked_head_columns(hidden, lambda h: h @ weight.T, ids, chunk=2).sum().backward()
    got = hidden.grad.clone()
    hidden.grad = None
    torch.gather(torch.log_softmax(hidden @ weight.T, -1), -1, ids).sum().backward()
    torch.testing.assert_close(got, hidden.grad)


def test_layouts_move_per_position_values_both_ways():
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 0, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])  # P = 3, R = 3
    per_pos = torch.arange(18.0).view(2, 3, 3)  # [B, R, k]
    for layout in (pack_rows(ids, attn, 3), pad_rows(ids, attn, 3)):
        back = layout.to_rows(layout.from_rows(per_pos))
        predicted = back.abs().sum(-1) > 0
        assert torch.equal(back[predicted], per_pos[predicted])
    p = pack_rows(ids, attn, 3)
    assert p.from_rows(per_pos).shape == (1, 3, 3) and p.from_rows(per_pos)[0, 2].tolist() == [9.0, 10.0, 11.0]


PATHS = {"packed, chunked": {"max_tokens_per_micro_batch": 40},
         "padded, full logits": {"packing": "off", "logprob_chunk_tokens": 0}}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_teacher_returns_its_topk_and_a_student_gathers_there(tiny_model, path):
    batch = rl_batch(6, seed=3)
    mask = batch["response_mask"].bool()
    teacher = HFInferEngine(EngineSpec(tiny_model, temperature=0.8, options={
        "micro_batch_size": 4, "topk_logprobs": 5, **PATHS[path]}))
    out = teacher.infer(batch)
    assert out["topk_ids"].shape == (*mask.shape, 5) and out["topk_ids"].dtype == torch.long
    assert (out["topk_logprobs"][mask].diff(dim=-1) <= 1e-6).all()  # sorted, largest first
    # the sampled token's logprob is one of the k largest at most as often as it should be: it is the
    # logprob of one of the returned ids exactly when its id is among them
    hit = (out["topk_ids"] == batch["input_ids"][:, -mask.shape[1]:].unsqueeze(-1)) & mask.unsqueeze(-1)
    at_hit = (out["topk_logprobs"] * hit).sum(-1)[hit.any(-1)]
    torch.testing.assert_close(at_hit, out["logprobs"][hit.any(-1)], atol=1e-5, rtol=1e-5)

    student = HFTrainEngine(EngineSpec(tiny_model, temperature=0.8, seed=0, options={
        "micro_batch_size": 4, "lr": 1e-3, **PATHS[path]}))
    fwd = student.forward(batch, gather=out["topk_ids"])  # same weights: the student's logprobs there are the teacher's
    torch.testing.assert_close(fwd.gathered[mask], out["topk_logprobs"][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fwd.logprobs * mask, out["logprobs"] * mask, atol=1e-5, rtol=1e-5)
    fwd.gathered[mask].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.hf.model.parameters())


def test_both_paths_agree_on_the_topk(tiny_model):
    batch = rl_batch(6, seed=4)
    mask = batch["response_mask"].bool()
    outs = [HFInferEngine(EngineSpec(tiny_model, options={"micro_batch_size": 4, "topk_logprobs": 3, **o}))
            .infer(batch) for o in PATHS.values()]
    torch.testing.assert_close(outs[0]["topk_logprobs"][mask], outs[1]["topk_logprobs"][mask], atol=2e-5, rtol=1e-5)
