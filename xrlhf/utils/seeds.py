"""Seeds derived from keys: the one hash behind every keyed random stream of a run.

A sample of a batch, a turn of an episode, an eval prompt and a row restarted after a weight
update each draw from their own stream, seeded by a function of what identifies them, never of
timing or of the split over generators. That is what makes a batch regenerated on resume (or
after a generator was restarted) equal to the one lost. Every such seed comes from ``seed_of``;
the rollout layer (``sample_seed``, ``turn_seed``) and the generate engines (``derive_seed``)
only choose the keys. A leaf module: engines and algorithms both import it.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93,
                0xA0761D6478BD642F, 0xE7037ED1A0B428DB)


def seed_of(*keys: int) -> int:
    """A 63-bit seed from up to six integer keys (negative keys allowed).

    Each key is spread by its own odd multiplier, summed mod 2^64 and passed through SplitMix64's
    finaliser, so neighbouring keys give unrelated streams; 63 bits because vLLM keeps seeds in
    int64 and ``torch.Generator.manual_seed`` takes them.
    """
    if len(keys) > len(_MULTIPLIERS):
        raise ValueError(f"seed_of takes at most {len(_MULTIPLIERS)} keys, got {len(keys)}")
    x = 0
    for k, m in zip(keys, _MULTIPLIERS):
        x = (x + (int(k) & _MASK64) * m) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


# The first key names what is seeded, so that no two kinds of stream share a seed.
_SAMPLE, _TURN, _ATTEMPT = 1, 2, 3


def sample_seed(seed: int, batch: int, row: int, attempt: int = 0) -> int:
    """The stream of sample ``row`` of batch ``batch`` (``-1``: the evaluation) in generation
    round ``attempt`` (dynamic sampling generates more prompts in further rounds)."""
    return seed_of(_SAMPLE, seed, batch, row, attempt)


def turn_seed(seed: int, turn: int) -> int:
    """Turn ``turn`` (0-based) of the episode whose sample seed is ``seed``: the sample's own seed
    for the first turn, a derived one after."""
    return seed if turn == 0 else seed_of(_TURN, seed, turn)


def derive_seed(seed: int, attempt: int) -> int:
    """A row's ``attempt``-th start (``SamplingParams.on_update == "abort"`` restarts a row whose
    weights changed under it): ``seed`` itself for attempt 0, a derived one after."""
    return int(seed) if attempt == 0 else seed_of(_ATTEMPT, seed, attempt)
