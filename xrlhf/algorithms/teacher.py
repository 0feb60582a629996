"""Distillation's two data parts: the teacher's scoring of a batch, and GKD's teacher
completions added to it (``algorithms/distill.py`` holds them)."""

from __future__ import annotations

import time

import torch

from xrlhf.data.batch import Batch, build_sequences, response_loss_masks, unpack_sequences
from xrlhf.data.datasets import COMPLETIONS, DatasetPath, EpochOrder, load_rows
from xrlhf.data.text import encode_prompt, encode_target
from xrlhf.engines.handles import Handle
from xrlhf.utils.timeline import Timeline


class Teacher:
    """The teacher handle's logprobs of a batch's tokens, scored alone (not beside the student's
    forward) so that its throughput is its own."""

    def __init__(self, handle: Handle, timeline: Timeline):
        self.handle, self.timeline = handle, timeline

    def score(self, batch: Batch, timings: dict[str, float]) -> dict[str, float]:
        """Writes ``teacher_logprobs`` ``[B, R]`` (and with ``teacher.infer.topk_logprobs`` k,
        ``teacher_topk_ids`` / ``teacher_topk_logprobs`` ``[B, R, k]``, read by the loss) into
        ``batch``; returns ``perf/teacher_tokens_per_s``."""
        t0 = time.time()
        with self.timeline.span("trainer", "teacher"):
            out = self.handle.infer(batch.select("input_ids", "attention_mask", "response_mask"))
        batch["teacher_logprobs"] = out["logprobs"]
        if "topk_ids" in out:  # read by the loss (PolicyLoss.topk_coef)
            batch["teacher_topk_ids"], batch["teacher_topk_logprobs"] = out["topk_ids"], out["topk_logprobs"]
        seconds = time.time() - t0
        timings["time/teacher_s"] = seconds
        tokens = float(batch["response_mask"].sum())
        return {"perf/teacher_tokens_per_s": tokens / max(seconds, 1e-9)}


class OfflineRows:
    """Teacher completions ``{prompt, completion}`` appended to each update's batch (GKD's mixed
    on/off-policy data): ``fraction`` of the rows after the addition, in a seeded epoch order.

    Args:
        path: the dataset (JSONL / parquet).
        fraction: the share of each update's rows taken from it, in ``[0, 1)``.
        seed: the run's seed (``EpochOrder(n, seed, "distill")``).
        tokenizer: the policy's tokenizer.
    """

    def __init__(self, path: DatasetPath, fraction: float, seed: int, tokenizer):
        self.rows = load_rows(path, COMPLETIONS)
        self.order = EpochOrder(len(self.rows), seed, "distill")
        self.fraction, self.tok = fraction, tokenizer

    def extend(self, batch: Batch, step_idx: int) -> Batch:
        """``batch`` of step ``step_idx + 1`` with its teacher completions appended (re-laid out:
        prompts left-padded, responses right-padded), each its own group, scored 0, sampled "now"."""
        s = step_idx + 1
        k = max(1, round(len(batch) * self.fraction / (1 - self.fraction)))
        rows = [self.rows[i] for i in self.order.take((s - 1) * k, k)]
        prompts, responses = unpack_sequences(batch)
        masks = response_loss_masks(batch)
        tok = self.tok
        prompts += [encode_prompt(tok, r["prompt"]) for r in rows]
        targets = [encode_target(tok, r["completion"]) for r in rows]
        out = build_sequences(prompts, responses + targets, tok.pad_token_id,
                              response_masks=masks + [[1.0] * len(t) for t in targets])
        width, n = out["response_mask"].shape[1], len(batch)
        for key in batch.keys():
            if key in out.tensors:
                continue
            t = batch[key]
            if t.dim() == 2:  # per token, aligned with the responses: pad to the new width, 0 for the new rows
                t = torch.nn.functional.pad(t, (0, width - t.shape[1]))
                out[key] = torch.cat([t, torch.zeros((k, width), dtype=t.dtype)])
            elif key == "group_ids":
                out[key] = torch.cat([t, torch.arange(k, dtype=t.dtype) + int(t.max()) + 1])
            else:
                out[key] = torch.cat([t, torch.zeros((k,), dtype=t.dtype)])
        if "token_versions" in out:  # the teacher's tokens count as the current policy's: no staleness
            out["token_versions"][n:] = step_idx * out["response_mask"][n:].long()
        return out
