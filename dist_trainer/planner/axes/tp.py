"""Tensor parallelism in the planner: Megatron's f/g (Shoeybi et al. 2019), 2 all-reduces of b s h forward and
2 backward per layer and micro-batch (under SP an all-gather + reduce-scatter pair of the same volume,
Korthikanti et al. 2022; on gloo, which has no reduce-scatter, parallel/comm.py all-reduces and keeps a slice),
2 more per recomputed layer, one for the embedding and one for the LM head's input, and the vocab-parallel
loss's two small all-reduces. Each sits between two dependent matmuls, so none overlaps: all exposed. A
blocking call also waits for peers still computing (``HardwareProfile.sync_cost``). Candidates: the divisors of
the ranks per node (a TP group stays in a node), each with and without sequence parallelism."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dist_trainer.layout_rules import Layout, divisors
from dist_trainer.planner.activation_spec import recomputed_layers
from dist_trainer.planner.axes.base import AxisEntry, AxisTime, Fields, SearchSpace, StepContext, ring_time


class TensorParallel(AxisEntry):
    name = "tp"

    def candidates(self, space: SearchSpace, chosen: Mapping[str, Any]) -> list[Fields]:
        sizes = [space.tp_size] if space.tp_size else divisors(space.ranks_per_node)
        return [{"tp_size": t} for t in sizes if space.max_tp_size is None or t <= space.max_tp_size]

    def variants(self, space: SearchSpace, layout: Layout) -> list[Fields]:
        return [{"sequence_parallel": False}, {"sequence_parallel": True}] if layout.tp_size > 1 else [{}]

    def lightest(self, layout: Layout) -> Fields:
        return {"sequence_parallel": layout.tp_size > 1}

    def time(self, ctx: StepContext) -> dict[str, AxisTime]:
        layout, hardware, t = ctx.layout, ctx.hardware, ctx.layout.tp_size
        if t == 1:
            return {}
        m, tokens = layout.n_microbatches, ctx.tokens
        bsh = tokens * ctx.cfg.d_model * ctx.act_bytes
        recomputed = max(len(recomputed_layers(layout.activation_checkpointing, layout.checkpoint_every, ids))
                         for ids in ctx.layers)
        sp = layout.sequence_parallel
        # per micro-batch: 4 per layer, 2 per recomputed layer, the embedding's and the LM head's (one stage holds
        # each when p > 1: the last one's head is counted), in units of one all-reduce or SP's gather + scatter
        calls = (4 * ctx.most_layers + 2 * recomputed + (2 if layout.pp_size == 1 else 1)) * m
        intra = ctx.intra  # a TP group stays inside a node
        per_call = (ring_time("all_gather", bsh, t, *intra) + ring_time(hardware.scatter_kind(), bsh, t, *intra)
                    if sp else ring_time("all_reduce", bsh, t, *intra))
        # the vocab-parallel loss: the row max and the (target logit, exp sum) pairs, fp32 per token
        loss = m * (ring_time("all_reduce", 4 * tokens, t, *intra) + ring_time("all_reduce", 8 * tokens, t, *intra))
        blocking = calls * (2 if sp else 1) + 2 * m  # SP: a gather and a scatter for each all-reduce
        time = calls * per_call + loss + blocking * hardware.sync_cost(t, ctx.compute / blocking)
        return {"tp": AxisTime(2 * (t - 1) / t * (calls * bsh + 12 * m * tokens), time, time,
                               "between dependent matmuls: all exposed")}


AXIS = TensorParallel()
