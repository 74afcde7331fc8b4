"""The time of activation offload (``parallel.activation_offload``, ``model_offload.py``) over the host link.

Each offloaded layer's saved tensors cross the host link twice a micro-batch: out during forward (on a side stream,
beside the next layer's forward) and back during backward (one layer ahead, beside the later layer's backward). So
the copies hide behind the offloaded layers' own share of the compute, and what exceeds it is exposed:
bytes = 2 x the offloaded bytes of a micro-batch x m, time = bytes / ``pcie_bw``, exposed = max(0, time - compute x
offloaded layers / the rank's layers). The bytes are the planner's ``offloaded_to_host`` (the device bytes freed),
which tests/test_planner_activations.py checks against the bytes the hooks copy.
"""

from __future__ import annotations

import math

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import Layout
from dist_trainer.planner.activation_costs import OFFLOADED
from dist_trainer.planner.axes import AxisTime
from dist_trainer.planner.hardware import HardwareProfile
from dist_trainer.planner.memory import in_flight_of, stage_activation_bytes
from dist_trainer.planner.options import TrainingOptions


def activation_offload_time(cfg: ModelConfig, layout: Layout, *, seq_len: int, options: TrainingOptions,
                            hardware: HardwareProfile, compute: float, most_layers: int,
                            offloaded: int | None = None) -> AxisTime | None:
    """The host link's traffic of the first pipeline rank's offloaded layers in one step (module docstring).
    ``offloaded``: that rank's ``offloaded_to_host`` bytes, when the caller has them (the search's Pricer)."""
    if not layout.activation_offload:
        return None
    if offloaded is None:
        offloaded = stage_activation_bytes(cfg, layout, seq_len=seq_len, options=options, pp_rank=0).get(OFFLOADED, 0)
    per_micro = offloaded / in_flight_of(layout, 0)
    moved = 2.0 * per_micro * layout.n_microbatches
    time = moved / hardware.pcie_bw
    layers = math.ceil(layout.activation_offload * most_layers - 1e-9)
    hidden = compute * layers / most_layers
    return AxisTime(moved, time, max(0.0, time - hidden),
                    "saved activations to the host and back, beside the offloaded layers' own compute")
