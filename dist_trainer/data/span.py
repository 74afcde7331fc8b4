"""T5's span corruption (Raffel et al. 2020, section 3.1.4): one sample's corruption (numpy only); the counts and
lengths it keeps to are ``facts/span.py``'s.

Which tokens are noise is random per sample (``noise_mask``, T5's ``random_spans_noise_mask``: the noise and
non-noise runs are each a random composition into the same number of spans, non-noise first), drawn from a generator
seeded by (seed, step, sample index) only, so every layout trains on the same inputs; ``corrupt`` replaces each span
by its sentinel (``<extra_id_k>`` for the k-th span) in the input and lists it in the target.
"""

from __future__ import annotations

import numpy as np

from dist_trainer.facts.span import noise_counts


def _segments(n_items: int, n_segments: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random composition of ``n_items`` into ``n_segments`` positive parts (T5's
    ``_random_segmentation``: n_segments - 1 cut points among the n_items - 1 gaps)."""
    cuts = np.sort(rng.permutation(n_items - 1)[: n_segments - 1]) + 1
    return np.diff(np.concatenate([[0], cuts, [n_items]]))


def noise_mask(length: int, noise_density: float, mean_noise_span: float, rng: np.random.Generator) -> np.ndarray:
    """(length,) bool, True at noise tokens: spans of noise alternating with spans of kept tokens, kept first."""
    noise, spans = noise_counts(length, noise_density, mean_noise_span)
    kept_runs, noise_runs = _segments(length - noise, spans, rng), _segments(noise, spans, rng)
    runs = np.stack([kept_runs, noise_runs], axis=1).reshape(-1)  # kept, noise, kept, noise, ...
    return np.repeat(np.tile([False, True], spans), runs)


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinels: list[int], eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(encoder input, target) of one window: each noise span replaced by its sentinel in the input; each sentinel
    followed by its span's tokens in the target; EOS closing both."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])  # the first token of each noise span
    n = int(starts.sum())
    if n > len(sentinels):
        raise ValueError(f"{n} noise spans need as many sentinels, {len(sentinels)} given")
    sentinel_of = np.asarray(sentinels[:n], dtype=tokens.dtype)[np.maximum(np.cumsum(starts) - 1, 0)]
    inputs = np.where(starts, sentinel_of, tokens)[~mask | starts]
    targets = np.insert(tokens[mask], np.flatnonzero(starts[mask]), sentinels[:n])  # sentinel before each span
    return (np.concatenate([inputs, [eos]]).astype(tokens.dtype), np.concatenate([targets, [eos]]).astype(tokens.dtype))


def sample_rng(seed: int, step: int, index: int) -> np.random.Generator:
    """A numpy generator seeded by (seed, step, sample index) only (SeedSequence: no hash())."""
    return np.random.default_rng(np.random.SeedSequence([seed, step, index, 24]))
