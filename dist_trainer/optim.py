"""AdamW with decoupled weight decay on matrices only (moments in ``optim.state_dtype``), and warmup + cosine
learning rate."""

from __future__ import annotations

import math

import torch
from torch import nn

from dist_trainer.config import OptimConfig
from dist_trainer.optim_lowbit import build_adamw


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights; never biases, norm weights or embeddings (GPT-3 / Megatron practice).

    Parameters are listed in ``named_parameters`` order so every regime builds the same groups.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = name.endswith("_emb.weight")
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partition is a 1-D placeholder: use its full shape
        (decay if ndim >= 2 and not is_embedding else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters, its moments in ``optim.state_dtype`` (``optim_lowbit.py``)."""
    return build_adamw(param_groups(model, cfg.weight_decay), cfg)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup to ``lr`` over warmup_steps, then cosine decay to ``min_lr`` at max_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
