"""Weighted mixtures of prepared folders (``data.sources``): which source each sample of a step comes from.

The run's samples form one sequence over all steps, slot ``g = step * B + i``. Slot after slot, the sources are
handed out by Sainte-Lague/Webster apportionment of the weights: source s's k-th sample (k = 1, 2, ...) sits at the
threshold (k - 1/2) / w_s, and the slots take the thresholds in increasing order (ties by source order). So after
any number n of slots each source holds within about one sample of ``w_s / sum(w) * n`` (no random drift: the share
of every source is exact to 1/n, at any run length), and the counts up to any slot are a closed formula
(``source_counts``), not a replay of the run. A step's global batch therefore depends only on (weights, seed, step):

    counts before = source_counts(step * B), after = source_counts((step + 1) * B)
    the step's B slots = the thresholds between them, in order -> a source per slot
    source s's j-th sample overall = permutation(seed, s, j // n_s)[j % n_s]   (an epoch per pass over s)

which is the same whatever the DP degree and the world size: the DP ranks cut it as they cut a single folder's
batch (``GlobalBatchSampler.micro_batches``), and a resume at another layout continues with the next batches.
Each source's samples are a fresh permutation per pass over it (a small source repeats sooner than a large one,
and nothing is dropped at the end of a pass).

The samples of all sources are one index space (``MixtureDataset``: source s's local index i is
``offsets[s] + i``), so the batch builders (``objective.make_batch``) read a mixture as they read one folder.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from dist_trainer.data.dataset import data_fingerprint
from dist_trainer.data.sampler import GlobalBatchSampler
from dist_trainer.facts.sources import Source


def check_source_folders(sources: list[Source]) -> None:
    """Every folder exists and all were tokenized with one vocabulary; ValueError naming the source (or both
    folders and their vocabulary hashes) otherwise. Reads meta.json only."""
    from dist_trainer.data.dataset import META_FILE
    from dist_trainer.data.tokenizer import data_vocab_hash

    for i, s in enumerate(sources):
        if not (Path(s.path) / META_FILE).is_file():
            what = "does not exist" if not Path(s.path).exists() else f"holds no {META_FILE}"
            raise ValueError(f"data.sources[{i}] ({s.path}, weight {s.weight:g}): the folder {what}; run "
                             f"`dist-trainer prepare --out {s.path}` first")
    first, first_hash = sources[0], data_vocab_hash(sources[0].path)
    for i, s in enumerate(sources[1:], 1):
        other = data_vocab_hash(s.path)
        if other != first_hash:
            raise ValueError(f"data.sources[{i}] ({s.path}) was tokenized with another tokenizer than "
                             f"data.sources[0] ({first.path}): vocabulary sha256 {other} vs {first_hash}; prepare "
                             f"{s.path} again with `dist-trainer prepare --tokenizer {first.path}`")


def source_counts(weights: list[Fraction], n: int) -> list[int]:
    """How many of the first ``n`` slots each source holds (Webster apportionment, module docstring): the n
    smallest thresholds (k - 1/2) / w_s, ties by source order. Exact (rational arithmetic), O(S^2) for any n."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    total, S = sum(weights), len(weights)
    # below lam every source's thresholds are counted in full, and they number at most n (sum(w lam + 1/2) <= n)
    lam = max(Fraction(0), (n - Fraction(S, 2)) / total)
    counts = [math.floor(w * lam + Fraction(1, 2)) for w in weights]
    left = n - sum(counts)  # at most S more thresholds: sum(w lam - 1/2) >= n - S
    assert 0 <= left <= S, (n, left)
    candidates = sorted(((2 * k - 1) / (2 * w), s) for s, w in enumerate(weights)
                        for k in range(counts[s] + 1, counts[s] + left + 1))
    for _, s in candidates[:left]:
        counts[s] += 1
    return counts


def slot_sources(weights: list[Fraction], start: int, stop: int) -> list[int]:
    """The source of each slot start..stop-1, in order (the thresholds between the two counts, sorted)."""
    before, after = source_counts(weights, start), source_counts(weights, stop)
    keyed = sorted(((2 * k - 1) / (2 * w), s) for s, w in enumerate(weights)
                   for k in range(before[s] + 1, after[s] + 1))
    return [s for _, s in keyed]


class MixtureSampler(GlobalBatchSampler):
    """A GlobalBatchSampler whose global batch draws from the sources by weight (module docstring); its DP cut
    into local and micro-batches is the base class's, so every layout reads the same global batch."""

    def __init__(self, sizes: list[int], weights: list[float], global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"{len(sizes)} source sizes for {len(weights)} weights")
        if min(sizes) < 1:
            raise ValueError(f"every source needs at least one sample; sizes {sizes}")
        # the base class checks the batch sizes and the DP cut; its single-folder epoch (and the rule that the
        # data holds one global batch) does not apply: each source runs its own passes (source_permutation)
        super().__init__(max(sum(sizes), global_batch_size), global_batch_size, micro_batch_size, dp_rank,
                         dp_size, seed)
        self.sizes = list(sizes)
        self.offsets = np.cumsum([0, *sizes]).tolist()
        self.weights = [Fraction(w) for w in weights]  # exact: a float's binary value, the same on every host
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def source_permutation(self, source: int, epoch: int) -> np.ndarray:
        """The order of source ``source``'s samples in its pass ``epoch``, from (seed, source, epoch) only."""
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.sizes):  # the current pass of each source, and the one before
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, source, epoch]).permutation(self.sizes[source])
        return self._perms[key]

    def global_batch(self, step: int) -> list[int]:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        B = self.global_batch_size
        position = source_counts(self.weights, step * B)  # how many samples of each source earlier steps read
        batch = []
        for s in slot_sources(self.weights, step * B, (step + 1) * B):
            epoch, i = divmod(position[s], self.sizes[s])
            batch.append(self.offsets[s] + int(self.source_permutation(s, epoch)[i]))
            position[s] += 1
        return batch

    def samples_seen(self, steps: int) -> list[int]:
        """Samples of each source read by steps 0..steps-1, every DP rank's together."""
        return source_counts(self.weights, steps * self.global_batch_size)

    def source_of(self, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1


class MixtureDataset:
    """The samples of several datasets of one split as one index space (``offsets[s] + local index``); the rest
    (meta, special tokens, vocabulary, path) is the first source's, which the others share (one tokenizer)."""

    def __init__(self, parts: list[Any], sources: list[Source]) -> None:
        self.parts, self.sources = parts, sources
        self.offsets = np.cumsum([0, *(len(p) for p in parts)]).tolist()
        first = parts[0]
        self.meta: dict[str, Any] = first.meta
        self.path = first.path
        self.vocab_size = first.vocab_size
        self.special_tokens = getattr(first, "special_tokens", {})

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> Any:
        s = bisect.bisect_right(self.offsets, index) - 1
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples of the mixture")
        return self.parts[s][index - self.offsets[s]]

    def fingerprint(self) -> str:
        """sha256 over each source's data fingerprint and weight: equal fingerprints, the same mixture."""
        lines = [f"{s.weight!r}:{data_fingerprint(p.meta)}" for s, p in zip(self.sources, self.parts)]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()
