"""Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 section 2.1.2; Wang et al. 2024, arXiv
2408.15664): after each training step, every MoE layer's expert bias moves by ``model.moe_bias_update_rate`` toward
balance, + rate for an expert that got fewer assignments than the mean over the step, - rate for one that got
more (the sign rule, Wang et al. Algorithm 1). The bias takes part in the top-k choice only (``model_moe_routing``).

The counts are the step's: every micro-batch of every data-parallel rank (one all-reduce over dp of all this
stage's layers; the other ranks of a layer's data-parallel replica route the same tokens, pipeline stages hold
other layers), so the
bias is the same on every rank and in every layout, and moves as the single process's would.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_trainer.config import ModelConfig
from dist_trainer.model_moe import moe_layers
from dist_trainer.parallel.state import ParallelState


@torch.no_grad()
def update_expert_bias(model: nn.Module, cfg: ModelConfig, state: ParallelState) -> None:
    """Nudge the expert bias of ``model``'s MoE layers by the step's loads, then zero the loads (no-op without
    ``model.moe_bias_update_rate``)."""
    rate = cfg.moe_bias_update_rate
    layers = [m for m in moe_layers(model) if m.expert_bias is not None]
    if not rate or not layers:
        return
    load = torch.stack([m.step_load if m.step_load is not None else torch.zeros(m.n_experts, dtype=torch.float64,
                        device=m.router.weight.device) for m in layers])  # (layers, E) float64
    state.dp.all_reduce(load)
    for m, row in zip(layers, load, strict=True):
        assert m.expert_bias is not None
        m.expert_bias += rate * torch.sign(row.mean() - row).to(m.expert_bias)
        if m.step_load is not None:
            m.step_load.zero_()
