"""Which samples each data-parallel rank reads at each step: a pure function of the step.

The global batch of a step is the same whatever the DP degree, so a run resumed on
another layout (or compared against a single-process reference) sees the same data:

    epoch, b = divmod(step, batches_per_epoch)
    global_batch(step) = permutation(seed, epoch)[b * B : (b + 1) * B]
    rank r reads global_batch(step)[r * B / dp : (r + 1) * B / dp], in micro-batches

Each epoch is a fresh permutation of all samples, drawn from a numpy Generator seeded
by (seed, epoch) (never the global RNG). The ``n_samples % B`` samples at the end of an
epoch's permutation are skipped so that no batch crosses an epoch boundary; a
different permutation drops different ones each epoch.
"""

from __future__ import annotations

import numpy as np


class GlobalBatchSampler:
    """Stateless in the step: ``global_batch(n)`` is the same for a fresh sampler and one that ran n steps."""

    def __init__(self, n_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int) -> None:
        for name, value in (("n_samples", n_samples), ("global_batch_size", global_batch_size),
                            ("micro_batch_size", micro_batch_size), ("dp_size", dp_size)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        per_step = micro_batch_size * dp_size
        if global_batch_size % per_step:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*dp_size "
                             f"= {micro_batch_size}*{dp_size} = {per_step}; use a multiple of {per_step}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}: valid ranks are "
                             f"0..{dp_size - 1}")
        if n_samples < global_batch_size:
            raise ValueError(f"the dataset holds n_samples={n_samples} samples, fewer than one global batch of "
                             f"global_batch_size={global_batch_size}; use a smaller batch, a shorter seq_len or "
                             "more data")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.n_samples = n_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.batches_per_epoch = n_samples // global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.grad_accum_steps = self.local_batch_size // micro_batch_size
        self._cached: tuple[int, np.ndarray] | None = None  # (epoch, permutation): one draw per epoch, not per step

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The order of all samples in ``epoch``, from a Generator seeded by (seed, epoch)."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_samples))
        return self._cached[1]

    def global_batch(self, step: int) -> list[int]:
        """The B sample indices of optimizer step ``step`` over all DP ranks."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        epoch, b = divmod(step, self.batches_per_epoch)
        B = self.global_batch_size
        return self.epoch_permutation(epoch)[b * B:(b + 1) * B].tolist()

    def local_batch(self, step: int) -> list[int]:
        """This DP rank's contiguous slice of the global batch."""
        n = self.local_batch_size
        return self.global_batch(step)[self.dp_rank * n:(self.dp_rank + 1) * n]

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's slice cut into grad_accum_steps micro-batches of micro_batch_size, in order."""
        local, m = self.local_batch(step), self.micro_batch_size
        return [local[i:i + m] for i in range(0, len(local), m)]

    def epoch_of(self, step: int) -> int:
        return step // self.batches_per_epoch
