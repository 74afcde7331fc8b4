"""The seam between the engines and the health monitor: the hooks an engine calls, what the monitor reads of it.

The engines call ``StepHooks`` inside ``optimizer_step`` (``engines/base.py``); the monitor (``monitor.py``)
implements them and reads the engine through ``ObservedEngine``. Both live here, below the engines, so health/
never imports the layer that calls it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dist_trainer.parallel.ownership import Piece


class StepHooks:
    """What the loop observes, or vetoes, between the final gradients and the update (``engines/base.py``).

    These defaults do nothing, so an engine used on its own (tests, the memory experiment) steps as before.
    """

    def grads_ready(self) -> None:
        """The gradients are final (reduced and summed where the regime sums them), not yet clipped."""

    def allow_update(self, grad_norm: torch.Tensor | None) -> bool:
        """Whether to apply this step's update; ``grad_norm``: the global norm before clipping, or None when
        the engine learns it only inside the update (DeepSpeed)."""
        return True


class ObservedEngine(Protocol):
    """What the health monitor reads of an engine (``engines.base.Engine`` is one)."""

    model: nn.Module

    def owned_pieces(self, grads: bool = True) -> list[Piece]: ...
