"""The sample layout of ``xrlhf.data.batch``: prompts left-padded, responses right-padded, written by hand."""

from __future__ import annotations

import pytest
import torch

from xrlhf.data.batch import build_sequences, right_padded, unpack_sequences


def test_build_sequences_lays_out_prompts_responses_masks_and_logprobs():
    batch = build_sequences([[1, 5, 6], [1], [7, 8]], [[9, 2], [], [3, 4, 2]], pad_id=0,
                            response_logprobs=[[-0.5, -0.25], [], [-1.0, -2.0, -3.0, -9.0]],  # extra values: cut
                            response_masks=[[1, 0], [], [0.5, 1, 1]])
    assert batch["input_ids"].tolist() == [[1, 5, 6, 9, 2, 0], [0, 0, 1, 0, 0, 0], [0, 7, 8, 3, 4, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1]]
    assert batch["response_mask"].tolist() == [[1, 0, 0], [0, 0, 0], [0.5, 1, 1]]
    assert batch["rollout_logprobs"].tolist() == [[-0.5, -0.25, 0], [0, 0, 0], [-1, -2, -3]]
    assert (batch["input_ids"].dtype, batch["attention_mask"].dtype, batch["response_mask"].dtype,
            batch["rollout_logprobs"].dtype) == (torch.long, torch.long, torch.float32, torch.float32)
    assert unpack_sequences(batch) == ([[1, 5, 6], [1], [7, 8]], [[9, 2], [], [3, 4, 2]])


def test_build_sequences_defaults_and_edges():
    batch = build_sequences([[4]], [[]], pad_id=7)  # R is at least 1
    assert batch["input_ids"].tolist() == [[4, 7]] and batch["response_mask"].tolist() == [[0.0]]
    assert "rollout_logprobs" not in batch
    batch = build_sequences([[1, 2], [3]], [[5], [6, 7]], pad_id=0)
    assert batch["response_mask"].tolist() == [[1, 0], [1, 1]]  # 1 on every response token by default
    assert batch["input_ids"].tolist() == [[1, 2, 5, 0], [0, 3, 6, 7]]
    logprobs = [[0.1], [0.2, 0.30000001192092896]]  # float32 rounding as torch's own
    assert torch.equal(build_sequences([[1, 2], [3]], [[5], [6, 7]], 0, logprobs)["rollout_logprobs"],
                       torch.tensor([[0.1, 0.0], [0.2, 0.30000001192092896]], dtype=torch.float32))
    with pytest.raises(ValueError):  # fewer logprobs than tokens
        build_sequences([[1]], [[5, 6]], 0, [[0.1]])


def test_right_padded():
    assert right_padded([[1, 2, 3], [], [4]], 4).tolist() == [[1, 2, 3, 0], [0, 0, 0, 0], [4, 0, 0, 0]]
    assert right_padded([[1, 2, 3], [], [4]], 4).dtype == torch.long
    assert right_padded([], 3).shape == (0, 3)
