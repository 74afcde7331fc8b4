"""T5's span corruption (Raffel et al. 2020, section 3.1.4): the arithmetic and one sample's corruption (numpy only).

From a window of raw tokens, ``noise_density`` of them (15%) are chosen in spans of mean length ``mean_noise_span``
(3); the encoder input keeps the other tokens with each span replaced by one sentinel (``<extra_id_k>`` for the k-th
span) and ends with EOS; the target lists each sentinel followed by the tokens it replaced, and ends with EOS. The
counts are fixed by the window's length, so every sample of a run has the same input and target length and no
padding (``span_lengths``, T5's ``random_spans_helper``): the raw window is the longest whose input fits
``data.seq_len`` exactly. Which tokens are noise is random per sample (``noise_mask``, T5's
``random_spans_noise_mask``: the noise and non-noise runs are each a random composition into the same number of
spans, non-noise first), drawn from a generator seeded by (seed, step, sample index) only, so every layout trains
on the same inputs.
"""

from __future__ import annotations

import numpy as np


def _counts(length: int, noise_density: float, mean_noise_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a window of ``length`` tokens, as T5 counts them (Python's round)."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    return noise, max(int(round(noise / mean_noise_span)), 1)


def corrupted_lengths(length: int, noise_density: float, mean_noise_span: float) -> tuple[int, int]:
    """(input length, target length) a window of ``length`` raw tokens corrupts to: the kept tokens plus one
    sentinel per span plus EOS; the noise tokens plus one sentinel per span plus EOS."""
    noise, spans = _counts(length, noise_density, mean_noise_span)
    return length - noise + spans + 1, noise + spans + 1


def span_lengths(seq_len: int, noise_density: float, mean_noise_span: float) -> tuple[int, int, int]:
    """(raw window, target length, spans) for an encoder input of exactly ``seq_len`` tokens: the longest raw window
    whose input fits (T5's ``random_spans_helper``; its input length grows by 0 or 1 per raw token, so the longest
    fitting window fills ``seq_len`` exactly). ValueError when ``seq_len`` is too short for one span."""
    if seq_len < 4:
        raise ValueError(f"data.seq_len={seq_len} is too short for span corruption: an input holds kept tokens, a "
                         "sentinel per span and EOS (at least 4 tokens)")
    # the input length is nondecreasing in the window's (the noise count grows by 0 or 1 per token, the span count
    # only with it): bisect for the longest window that fits (a 128K planner search asks for thousands of layouts)
    length, too_long = 2, 2 * seq_len + 2  # a window of 2 * seq_len + 2 tokens keeps more than seq_len of them
    while too_long - length > 1:
        mid = (length + too_long) // 2
        if corrupted_lengths(mid, noise_density, mean_noise_span)[0] <= seq_len:
            length = mid
        else:
            too_long = mid
    inputs, targets = corrupted_lengths(length, noise_density, mean_noise_span)
    assert inputs == seq_len, (seq_len, length, inputs)
    return length, targets, _counts(length, noise_density, mean_noise_span)[1]


def _segments(n_items: int, n_segments: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random composition of ``n_items`` into ``n_segments`` positive parts (T5's
    ``_random_segmentation``: n_segments - 1 cut points among the n_items - 1 gaps)."""
    cuts = np.sort(rng.permutation(n_items - 1)[: n_segments - 1]) + 1
    return np.diff(np.concatenate([[0], cuts, [n_items]]))


def noise_mask(length: int, noise_density: float, mean_noise_span: float, rng: np.random.Generator) -> np.ndarray:
    """(length,) bool, True at noise tokens: spans of noise alternating with spans of kept tokens, kept first."""
    noise, spans = _counts(length, noise_density, mean_noise_span)
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
