"""The largest model of a family that trains at each ZeRO stage on a given GPU count and memory.

A family preset is scaled by its head count: n_heads = k * unit (unit keeps the GQA group and tp = 8 valid, and a
fixed ``--tp`` beyond 8 when one is given),
d_model = n_heads * head_dim (head_dim kept), n_layers grown in proportion (the preset's depth/width ratio),
d_ff kept at the preset's ratio to d_model (rounded to a multiple of 64). For each stage the largest k whose
least-memory layout (micro-batch 1, full recomputation, SP, 1F1B, every tp and pp) fits is found by bisection.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dist_trainer.config import ZERO_STAGES, ModelConfig
from dist_trainer.planner.hardware import HardwareProfile
from dist_trainer.planner.memory import DEFAULT_OPTIONS, DEFAULT_OVERHEADS, Overheads, TrainingOptions
from dist_trainer.planner.params import count_params
from dist_trainer.planner.search import PlannedLayout, plan_layouts


@dataclass(frozen=True)
class MaxModel:
    zero_stage: int
    offload: bool
    model: ModelConfig | None  # None: not even the smallest scaled model fits
    n_params: int
    planned: PlannedLayout | None


def scale_model(base: ModelConfig, k: int, *, seq_len: int, tp_size: int | None = None) -> ModelConfig:
    """The family member with ``k`` head units (see the module docstring); with ``tp_size`` every member splits
    over that many ranks (its head count a multiple of it)."""
    group = base.n_heads // base.kv_heads
    unit = math.lcm(group, 8) if base.n_heads >= 8 else group
    if tp_size is not None:
        unit = math.lcm(unit, tp_size)
    heads = k * unit
    d_model = heads * base.head_dim
    layers = max(1, round(base.n_layers * heads / base.n_heads))
    ffn = -(-round(base.ffn_dim / base.d_model * d_model) // 64) * 64
    return dataclasses.replace(base, preset=None, n_heads=heads, n_kv_heads=heads // group, d_model=d_model,
                               n_layers=layers, d_ff=ffn, max_seq_len=max(base.max_seq_len, seq_len))


def max_model(base: ModelConfig, *, n_gpus: int, gpus_per_node: int, gpu_memory_bytes: int, seq_len: int,
              global_batch: int, hardware: str | HardwareProfile = "A100-80GB",
              options: TrainingOptions = DEFAULT_OPTIONS, overheads: Overheads = DEFAULT_OVERHEADS,
              offload: bool = False, k_max: int = 4096, zero_stages: tuple[int, ...] = ZERO_STAGES,
              tp_size: int | None = None, **limits: Any) -> list[MaxModel]:
    """For each of ``zero_stages``: the largest scaled ``base`` with a layout that fits, by bisection on the scale.

    Stage s may use any allowed stage up to s (a stage-s run with dp = 1 is a stage-0 run); the layout says which.
    ``offload``: stages 1-3 use only offload layouts. ``tp_size`` and the other search ``limits`` (max_tp_size,
    pp_size, host memory per node, ...) are ``plan_layouts``'s.
    """

    def best(k: int, stage: int) -> PlannedLayout | None:
        cfg = scale_model(base, k, seq_len=seq_len, tp_size=tp_size)
        res = plan_layouts(cfg, n_gpus=n_gpus, gpus_per_node=gpus_per_node, gpu_memory_bytes=gpu_memory_bytes,
                           seq_len=seq_len, global_batch=global_batch, hardware=hardware, options=options,
                           overheads=overheads, zero_stages=tuple(z for z in zero_stages if z <= stage),
                           allow_offload=offload, checkpointing=("full",), pp_schedules=("1f1b",), tp_size=tp_size,
                           **limits)
        fitting = [p for p in res.layouts if p.layout.zero_offload or not offload or p.layout.zero_stage == 0]
        return min(fitting, key=lambda p: p.memory.device_total) if fitting else None

    out = []
    for stage in sorted(zero_stages):
        lo, hi = 0, 1
        while hi <= k_max and best(hi, stage) is not None:  # gallop up, then bisect
            lo, hi = hi, hi * 2
        hi = min(hi, k_max + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if best(mid, stage) is not None else (lo, mid)
        if lo == 0:
            out.append(MaxModel(stage, offload and stage > 0, None, 0, None))
            continue
        cfg = scale_model(base, lo, seq_len=seq_len, tp_size=tp_size)
        out.append(MaxModel(stage, offload and stage > 0, cfg, count_params(cfg), best(lo, stage)))
    return out
