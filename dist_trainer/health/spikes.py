"""A loss or grad-norm spike: a value far above the running statistics of the recent steps.

Large runs watch for spikes and skip the offending batch's update (Chowdhery et al. 2022, PaLM, section 5.1:
restart before the spike and skip 200-500 batches; OPT's logbook: lower the LR and skip). Here each series keeps
a window of its last ``window`` accepted values; a value is a spike when it lies more than ``threshold``
standard deviations above the window's mean, once the window holds ``warmup`` values (the first steps move too
fast to judge). Only upward moves count, and a skipped step's values never enter the window, so a run of spikes
cannot make itself look normal. Pure Python: the values are the floats the loop already has.
"""

from __future__ import annotations

import math
from collections import deque


class SpikeDetector:
    def __init__(self, window: int, threshold: float, warmup: int) -> None:
        if window < 2 or warmup < 2 or warmup > window:
            raise ValueError(f"spike detector: need 2 <= warmup={warmup} <= window={window}")
        self.window, self.threshold, self.warmup = window, threshold, warmup
        self.history: dict[str, deque[float]] = {}

    def check(self, values: dict[str, float]) -> str | None:
        """A description of the spiking series among ``values`` ("loss 7.1 is 9.3 std above ..."), or None."""
        found = []
        for name, x in values.items():
            past = self.history.get(name)
            if past is None or len(past) < self.warmup or not math.isfinite(x):
                continue
            mean = sum(past) / len(past)
            std = math.sqrt(sum((v - mean) ** 2 for v in past) / len(past))
            if std > 0 and (x - mean) / std > self.threshold:
                found.append(f"{name} {x:.4g} is {(x - mean) / std:.1f} std above the mean {mean:.4g} "
                             f"of the last {len(past)} steps (std {std:.3g})")
        return "; ".join(found) or None

    def accept(self, values: dict[str, float]) -> None:
        """Add a step that was applied to the running statistics."""
        for name, x in values.items():
            if math.isfinite(x):
                self.history.setdefault(name, deque(maxlen=self.window)).append(x)
