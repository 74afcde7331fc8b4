"""The gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

For a mean gradient over B i.i.d. samples, E[|G_B|^2] = |G|^2 + tr(Sigma) / B (section 2; Sigma is the
per-example gradient covariance). From squared norms at two batch sizes B_small < B_big, appendix A.1's
unbiased estimators are

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

and B_simple = tr(Sigma) / |G|^2 (eq. 2.9). The ratio of two noisy estimates is biased and very noisy, so
each estimate is smoothed with its own exponential moving average and the ratio is taken of the averages,
as the paper advises and EleutherAI's gpt-neox does (``gradient_noise_scale.py``: bias-corrected EMAs,
``scale / noise``).

In the trainer B_small is a micro-batch (each rank's micro-batches' gradients before any reduction, so it
works at dp = 1 through gradient accumulation) and B_big the step's global batch (the reduced gradient).
"""

from __future__ import annotations

from dataclasses import dataclass


def estimate(b_small: float, sq_small: float, b_big: float, sq_big: float) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) estimates from the squared gradient norms at two batch sizes."""
    if not 0 < b_small < b_big:
        raise ValueError(f"noise scale needs 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    grad_sq = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


@dataclass
class NoiseScale:
    """Bias-corrected EMAs of the two estimates; ``b_simple`` is the ratio of the averages."""

    beta: float = 0.9
    _grad_sq: float = 0.0
    _trace: float = 0.0
    _count: int = 0

    def update(self, b_small: float, sq_small: float, b_big: float, sq_big: float) -> dict[str, float]:
        grad_sq, trace = estimate(b_small, sq_small, b_big, sq_big)
        self._grad_sq = self.beta * self._grad_sq + (1 - self.beta) * grad_sq
        self._trace = self.beta * self._trace + (1 - self.beta) * trace
        self._count += 1
        correction = 1 - self.beta ** self._count  # Adam's bias correction: the EMAs start at zero
        g, s = self._grad_sq / correction, self._trace / correction
        return {"grad_sq": g, "trace": s, "b_simple": s / g if g > 0 else float("nan"),
                "b_simple_raw": trace / grad_sq if grad_sq > 0 else float("nan")}
