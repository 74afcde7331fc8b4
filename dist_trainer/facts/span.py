"""T5's span corruption, the arithmetic (Raffel et al. 2020, section 3.1.4; ``data/span.py`` corrupts the samples):
how many tokens and spans a window's noise holds, and the lengths it corrupts to. Torch-free, numpy-free: the
config's check and the planner read it.

From a window of raw tokens, ``noise_density`` of them (15%) are chosen in spans of mean length ``mean_noise_span``
(3); the encoder input keeps the other tokens with each span replaced by one sentinel and ends with EOS; the target
lists each sentinel followed by the tokens it replaced, and ends with EOS. The counts are fixed by the window's
length, so every sample of a run has the same input and target length and no padding (``span_lengths``, T5's
``random_spans_helper``): the raw window is the longest whose input fits ``data.seq_len`` exactly.
"""

from __future__ import annotations


def noise_counts(length: int, noise_density: float, mean_noise_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a window of ``length`` tokens, as T5 counts them (Python's round)."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    return noise, max(int(round(noise / mean_noise_span)), 1)


def corrupted_lengths(length: int, noise_density: float, mean_noise_span: float) -> tuple[int, int]:
    """(input length, target length) a window of ``length`` raw tokens corrupts to: the kept tokens plus one
    sentinel per span plus EOS; the noise tokens plus one sentinel per span plus EOS."""
    noise, spans = noise_counts(length, noise_density, mean_noise_span)
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
    return length, targets, noise_counts(length, noise_density, mean_noise_span)[1]
