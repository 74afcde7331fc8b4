"""Per-MoE-layer load metrics of a training step, for metrics.jsonl (docs/moe.md).

For every MoE layer ``i`` of the model, over the step's training forwards on every data-parallel rank:

    moe/layer{i}/tokens_per_expert   assignments routed to each expert (all k choices, before capacity)
    moe/layer{i}/dropped_frac        share of those assignments beyond the experts' capacity
    moe/layer{i}/aux_loss            the weighted Switch load-balancing loss, mean over micro-batches
    moe/layer{i}/z_loss              the weighted router z-loss, mean over micro-batches

Each rank's layers keep their counts (``MoE.router_stats``); one all-reduce over pp (stages hold different
layers) and one over dp (ranks route different tokens) sum them. The TP ranks of a layer hold the same figures.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_trainer.config import ModelConfig
from dist_trainer.model_moe import AUX, CALLS, DROPPED, Z, moe_layers
from dist_trainer.parallel.state import ParallelState


def router_metrics(model: nn.Module, cfg: ModelConfig, state: ParallelState) -> dict[str, Any]:
    """The step's load metrics of every MoE layer (empty for a dense model); collective over pp and dp."""
    layers = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    if not layers:
        return {}
    E = cfg.n_experts
    device = next(model.parameters()).device
    table = torch.zeros(len(layers), E + 4, dtype=torch.float64, device=device)
    for m in moe_layers(model):
        if m.router_stats is not None:
            table[layers.index(m.layer_id)] += m.router_stats.to(device)
    state.pp.all_reduce(table)
    state.dp.all_reduce(table)
    out: dict[str, Any] = {}
    for i, row in zip(layers, table.cpu()):
        assigned, calls = float(row[:E].sum()), max(float(row[E + CALLS]), 1.0)
        out[f"moe/layer{i}/tokens_per_expert"] = [int(x) for x in row[:E]]
        out[f"moe/layer{i}/dropped_frac"] = float(row[E + DROPPED]) / max(assigned, 1.0)
        out[f"moe/layer{i}/aux_loss"] = float(row[E + AUX]) / calls
        out[f"moe/layer{i}/z_loss"] = float(row[E + Z]) / calls
    return out
