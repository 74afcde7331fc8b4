"""The optimizer of ``optim.name`` (its entry in ``optim_entries.py``: AdamW by default, with decoupled weight
decay on matrices only and moments in ``optim.state_dtype``), and warmup + cosine learning rate."""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from torch import nn

from dist_trainer.config import OptimConfig
from dist_trainer.optim_entries import optimizer_entry
from dist_trainer.optim_muon import MatrixShard
from dist_trainer.parallel.comm import AxisGroup


def _decay_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float, **marks: Any) -> list[dict]:
    """Decay 2-D weights; never biases, norm weights or embeddings (GPT-3 / Megatron practice)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in params:
        (decay if len(full_shape(p)) >= 2 and not name.endswith("_emb.weight") else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, **marks},
            {"params": no_decay, "weight_decay": 0.0, **marks}]


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape (a ZeRO-3 partition is a 1-D placeholder: its full shape)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """The optimizer groups of ``optim.name``'s entry (``optim_entries.py``): the parameters it takes (decay and
    no-decay, marked with its ``group_marks``), then, for an entry with a fallback, the fallback's (decay and no-decay).

    Parameters are listed in ``named_parameters`` order so every regime builds the same groups; the groups are
    the same on every rank (some may be empty), so a checkpoint's groups pair with any layout's.
    """
    entry = optimizer_entry(cfg.name)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if entry.fallback is None:
        return _decay_groups(named, cfg.weight_decay)
    taken = [(n, p) for n, p in named if entry.takes(n, full_shape(p))]
    rest = [(n, p) for n, p in named if not entry.takes(n, full_shape(p))]
    return [*_decay_groups(taken, cfg.weight_decay, **dict(entry.group_marks)),
            *_decay_groups(rest, cfg.weight_decay)]


def group_states(group: dict[str, Any], cfg: OptimConfig) -> tuple[str, ...]:
    """The per-parameter state tensors the optimizer keeps for ``group``'s parameters: its entry's for the groups it
    marks (or all, without a fallback), the fallback's for the others."""
    entry = optimizer_entry(cfg.name)
    if entry.fallback is None or all(group.get(k) == v for k, v in entry.group_marks):
        return entry.states
    return optimizer_entry(entry.fallback).states


def param_states(name: str, p: torch.Tensor, cfg: OptimConfig) -> tuple[str, ...]:
    """``group_states`` of parameter ``name`` (its entry's ``takes`` decides)."""
    entry = optimizer_entry(cfg.name)
    return group_states(dict(entry.group_marks) if entry.takes(name, full_shape(p)) else {}, cfg)


def build_from_groups(groups: list[dict[str, Any]], cfg: OptimConfig, shards: dict[int, MatrixShard] | None = None,
                      zero: AxisGroup | None = None) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer over ``groups`` (its entry's builder). For the entries that need whole matrices
    (``optim_muon.py``): ``shards``, the matrices this rank holds a TP slice of; ``zero``, DeepSpeed's data-parallel
    axis when its ZeRO (any stage) partitions them."""
    entry = optimizer_entry(cfg.name)
    entry.check_state_dtype(cfg.state_dtype)
    module, function = entry.builder.split(":")
    build = getattr(importlib.import_module(module), function)
    placement = {k: v for k, v in (("shards", shards), ("zero", zero)) if v} if entry.group_marks else {}
    return build(groups, cfg, **placement)


def build_optimizer(model: nn.Module, cfg: OptimConfig, tp: AxisGroup | None = None) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer over ``model``'s trainable parameters (this rank's TP shard of them when ``tp``
    has more than one rank: each split matrix an entry takes is then orthogonalised on one owner, round robin)."""
    groups = param_groups(model, cfg)
    shards: dict[int, MatrixShard] = {}
    marks = optimizer_entry(cfg.name).group_marks
    if tp is not None and tp.size > 1 and marks:
        taken = [p for g in groups if all(g.get(k) == v for k, v in marks) for p in g["params"]]
        split = [p for p in taken if getattr(p, "tp_split_dim", None) is not None]
        shards = {id(p): MatrixShard(tp, p.tp_split_dim, i % tp.size) for i, p in enumerate(split)}
    return build_from_groups(groups, cfg, shards)


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
