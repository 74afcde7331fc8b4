"""Per-MoE-layer load metrics of a training step, for metrics.jsonl (docs/moe.md).

For every MoE layer ``i`` of the model, over the step's training forwards on every data-parallel rank:

    moe/layer{i}/tokens_per_expert   assignments routed to each expert (all k choices, before capacity)
    moe/layer{i}/load_max_mean       the busiest expert's assignments over the mean (1 = balanced)
    moe/layer{i}/dropped_tokens      assignments beyond the experts' capacity (0 dropless)
    moe/layer{i}/dropped_frac        their share of the assignments
    moe/layer{i}/bias_spread         the expert bias's max - min after the step (layers with model.expert_bias)
    moe/layer{i}/aux_loss            the weighted load-balancing loss, mean over micro-batches
    moe/layer{i}/z_loss              the weighted router z-loss, mean over micro-batches

Each rank's layers keep their counts (``MoE.router_stats``); one all-reduce over pp (stages hold different
layers) and one over dp (ranks route different tokens) sum them; the bias, the same on every rank, comes from dp
rank 0's. The TP ranks of a layer hold the same figures.
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
    table = torch.zeros(len(layers), E + 6, dtype=torch.float64, device=device)  # + the bias's max and min
    for m in moe_layers(model):
        row = table[layers.index(m.layer_id)]
        if m.router_stats is not None:
            row[:E + 4] += m.router_stats.to(device)
        if m.expert_bias is not None and state.dp.rank == 0:
            row[E + 4:] += torch.stack([m.expert_bias.max(), m.expert_bias.min()]).to(row)
    state.pp.all_reduce(table)
    state.dp.all_reduce(table)
    out: dict[str, Any] = {}
    for i, row in zip(layers, table.cpu()):
        assigned, calls = float(row[:E].sum()), max(float(row[E + CALLS]), 1.0)
        out[f"moe/layer{i}/tokens_per_expert"] = [int(x) for x in row[:E]]
        out[f"moe/layer{i}/load_max_mean"] = float(row[:E].max()) * E / max(assigned, 1.0)
        out[f"moe/layer{i}/dropped_tokens"] = int(row[E + DROPPED])
        out[f"moe/layer{i}/dropped_frac"] = float(row[E + DROPPED]) / max(assigned, 1.0)
        if cfg.expert_bias:
            out[f"moe/layer{i}/bias_spread"] = float(row[E + 4] - row[E + 5])
        out[f"moe/layer{i}/aux_loss"] = float(row[E + AUX]) / calls
        out[f"moe/layer{i}/z_loss"] = float(row[E + Z]) / calls
    return out
