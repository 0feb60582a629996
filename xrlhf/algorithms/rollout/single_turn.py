"""One-turn samples: ``n`` continuations of each prompt, generated in parts, each part scored as
it returns.

Every sample is drawn from its own seed (``utils.seeds.sample_seed(run seed, batch, row,
round)``), so a batch is a function of its index, its data position and the weights, whatever
the timing or the split over generators (exact resume and healing regenerate it). The parts
(``Sampling.parts``, from ``rollout.stream_rewards``) are sent at once: a generator that batches
concurrent calls (vLLM) runs them together, and the reward of an early part is computed while
later parts still generate.
"""

from __future__ import annotations

import time

from xrlhf.algorithms.rollout.types import Group, Reward, Sampling, Tally
from xrlhf.data.batch import Batch, build_sequences, right_padded
from xrlhf.data.lengths import check_prompt_lengths
from xrlhf.data.text import decode_responses, encode_prompt
from xrlhf.envs import Prompt
from xrlhf.utils.seeds import sample_seed
from xrlhf.utils.timeline import Timeline


class SingleTurn:
    """Samples and scores the groups of one-turn prompts.

    Args:
        sampling: samples per prompt, parameters, seed, parts.
        tokenizer: the policy's tokenizer.
        generator: the handle that samples (``Handles.generator``).
        reward: the run's reward source.
        timeline: where generation and scoring spans go.
    """

    def __init__(self, sampling: Sampling, tokenizer, generator, reward: Reward, timeline: Timeline):
        self.s, self.tok, self.generator, self.reward, self.timeline = sampling, tokenizer, generator, reward, timeline

    def groups(self, prompts: list[Prompt], b: int, attempt: int, tally: Tally) -> list[Group]:
        """``n`` scored samples of each of ``prompts``, as batch ``b``'s round ``attempt``."""
        n = self.s.n
        ids = [encode_prompt(self.tok, p.text) for p in prompts]
        check_prompt_lengths([i for i in ids for _ in range(n)], [p.text for p in prompts for _ in range(n)],
                             self.s.params.max_new_tokens, self.s.model)
        parts = cut(len(prompts), self.s.parts)
        t0 = time.time()
        pending = []
        for lo, hi in parts:  # all parts at once: the generator batches them together
            rows = [ids[i] for i in range(lo, hi) for _ in range(n)]
            seeds = [sample_seed(self.s.seed, b, row, attempt) for row in range(lo * n, hi * n)]
            pending.append(self.generator.generate(rows, self.s.params, seeds, wait=False))
        groups: list[Group] = []
        for i, ((lo, hi), call) in enumerate(zip(parts, pending)):
            out = call.get()
            self.timeline.add("generator", f"b{b}" + (f".{i}" if len(parts) > 1 else ""), t0, time.time())
            tally.generate_s = time.time() - t0
            with self.timeline.span("reward", f"b{b}"):
                groups += self._score(prompts[lo:hi], ids[lo:hi], out, tally)
        return groups

    def _score(self, prompts: list[Prompt], ids: list[list[int]], out, tally: Tally) -> list[Group]:
        n = self.s.n
        t0 = time.time()
        expanded = [p for p in prompts for _ in range(n)]
        rows = [i for i in ids for _ in range(n)]
        logprobs = out.logprobs or [[] for _ in out.token_ids]  # (none asked: Sampling.params.logprobs)
        batch = build_sequences(rows, out.token_ids, self.tok.pad_token_id)
        texts = decode_responses(self.tok, out.token_ids)
        scores, metrics = self.reward(expanded, texts, batch)
        scores = scores.float()
        tally.add_reward_metrics(metrics, len(prompts))
        tally.reward_s += time.time() - t0
        tally.tokens += float(sum(len(t) for t in out.token_ids))
        versions = out.versions or [[0] * len(t) for t in out.token_ids]
        return [Group(p, i, out.token_ids[g * n:(g + 1) * n], logprobs[g * n:(g + 1) * n],
                      versions[g * n:(g + 1) * n], texts[g * n:(g + 1) * n], scores[g * n:(g + 1) * n])
                for g, (p, i) in enumerate(zip(prompts, ids))]


    def assemble(self, groups: list[Group]) -> tuple[Batch, dict[str, float]]:
        """The groups' samples as one batch (``token_versions`` included)."""
        n = self.s.n
        rows = [g.prompt_ids for g in groups for _ in range(n)]
        tokens = [t for g in groups for t in g.tokens]
        logprobs = [lp for g in groups for lp in g.logprobs] if self.s.params.logprobs else None
        batch = build_sequences(rows, tokens, self.tok.pad_token_id, logprobs)
        versions = [v for g in groups for v in g.versions]
        batch["token_versions"] = right_padded(versions, batch["response_mask"].shape[1])
        return batch, {}


def cut(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` in ``min(parts, n)`` consecutive ranges of near-equal size."""
    parts = max(1, min(parts, n))
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
