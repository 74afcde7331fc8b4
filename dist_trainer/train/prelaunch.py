"""Every check a layout must pass before any process group exists, in one place.

The trainer runs it on its config; ``--parallel.layout=auto`` runs it on each candidate the
planner ranks, so the layout it picks is one the trainer will accept.
"""

from __future__ import annotations

import dataclasses

import torch

from dist_trainer.config import Config
from dist_trainer.parallel.tensor_parallel import validate_tp
from dist_trainer.train.pipeline_engine import validate_pipeline_config


def check_layout(cfg: Config, world_size: int, device: torch.device) -> int:
    """Raise ValueError naming the values if ``cfg`` cannot run on ``world_size`` ranks; return dp_size."""
    cfg.validate()
    dp = cfg.parallel.resolve(world_size)
    validate_tp(cfg.model, cfg.parallel.tp_size)
    if cfg.parallel.pp_size > 1:
        validate_pipeline_config(cfg, dp)
    if cfg.parallel.zero_stage > 0:
        from dist_trainer.parallel.zero_config import validate_zero_config  # DeepSpeed only when asked for

        validate_zero_config(cfg, dp, device.type)
    if cfg.train.precision == "fp16" and device.type != "cuda":
        raise ValueError("train.precision=fp16 needs CUDA (dynamic loss scaling); use bf16 or fp32 on CPU")
    return dp


def fit_micro_batch(cfg: Config, world_size: int) -> tuple[Config, str | None]:
    """``cfg`` with a micro-batch that divides each DP rank's share of the global batch, and a note saying so.

    The global batch decides the training (the same samples per step in every layout); the micro-batch only how
    they are cut. A config written for 2 processes (global 16 = micro 8 x dp 2) run on 4 therefore keeps its
    global batch and takes the largest micro-batch <= the configured one that divides 16 / 4 = 4 (here 4), with
    a note, instead of refusing. A global batch that dp does not divide stays an error (``check_layout``).
    """
    p = cfg.parallel
    try:
        dp = p.dp_degree(world_size)
    except ValueError:
        return cfg, None  # check_layout reports it
    per_rank, rem = divmod(p.global_batch_size, dp)
    if rem or per_rank % p.micro_batch_size == 0:
        return cfg, None
    micro = max(d for d in range(1, min(p.micro_batch_size, per_rank) + 1) if per_rank % d == 0)
    note = (f"parallel.micro_batch_size={p.micro_batch_size} does not divide the {per_rank} sequences per "
            f"data-parallel rank (global_batch_size={p.global_batch_size} over dp_size={dp}); using "
            f"micro_batch_size={micro} (same global batch, so the same training; pass "
            f"--parallel.micro_batch_size to choose another divisor of {per_rank})")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, micro_batch_size=micro)), note
