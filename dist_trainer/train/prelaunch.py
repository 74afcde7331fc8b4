"""Every check a layout must pass before any process group exists, in one place.

The trainer runs it on its config; ``--parallel.layout=auto`` runs it on each candidate the
planner ranks, so the layout it picks is one the trainer will accept.
"""

from __future__ import annotations

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
    if cfg.train.eval_every and cfg.train.eval_batches % dp:
        raise ValueError(f"train.eval_batches={cfg.train.eval_batches} must be a multiple of dp_size={dp} "
                         "(the eval set is split evenly over data-parallel ranks)")
    return dp
