"""Expert parallelism in the planner (its arithmetic: ``planner/moe.py``). ep: per MoE layer and micro-batch the
dispatch buffer goes to the experts' ranks and their outputs come back, two all-to-alls forward and two backward
(two more per recomputed MoE layer), each sending (ep - 1)/ep of the buffer, inside a node when the ep group's
ep x pp x tp consecutive ranks fit one; each sits between two dependent computations (router -> experts ->
combine): all exposed. edp: the experts' gradients, over the expert-data-parallel group (dp / ep ranks) instead
of dp: one flat all-reduce after backward (exposed), or ZeRO-1/2's reductions and gather over edp (the dp
entry's rules). Candidates: 1, and for a MoE model every divisor of dp that divides the experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import Layout, divisors
from dist_trainer.planner.activation_spec import recomputed_layers
from dist_trainer.planner.axes.base import AxisEntry, AxisTime, Fields, SearchSpace, StepContext, ring_time
from dist_trainer.planner.axes.dp import DataParallel, replica_time
from dist_trainer.planner.moe import all_to_all_bytes, dispatch_elements, ep_link_is_intra, moe_layer_ids

if TYPE_CHECKING:
    from dist_trainer.planner.options import TrainingOptions


class ExpertParallel(AxisEntry):
    name = "ep"

    def candidates(self, space: SearchSpace, chosen: Mapping[str, Any]) -> list[Fields]:
        n_experts = space.model.n_experts
        sizes = [e for e in divisors(chosen["dp_size"]) if e == 1 or n_experts % e == 0] if n_experts else [1]
        return [{"ep_size": e} for e in sizes]

    def time(self, ctx: StepContext) -> dict[str, AxisTime]:
        cfg, layout, options = ctx.cfg, ctx.layout, ctx.options
        ep, edp = layout.ep_size, layout.dp_size // layout.ep_size
        if ep == 1 or not cfg.n_experts:
            return {}
        ids = max(ctx.layers, key=lambda x: len(moe_layer_ids(cfg, x)))
        counted = ep_counted_bytes(cfg, layout, options, seq_len=ctx.seq_len, layer_ids=ids)
        n_moe, recomputed, in_b, out_b = _ep_exchange(cfg, layout, options, ids)
        elems = dispatch_elements(cfg, micro_batch=layout.micro_batch_size, seq_len=ctx.seq_len)
        ep_link = ctx.intra if ep_link_is_intra(ep_size=ep, tp_size=layout.tp_size, pp_size=layout.pp_size,
                                                gpus_per_node=ctx.gpus_per_node) else ctx.inter
        one = {b: (ep - 1) / ep * elems * b / ep_link[0] + (ep - 1) * ep_link[1] for b in (in_b, out_b)}
        calls = layout.n_microbatches * (2 * n_moe + recomputed)  # of each direction
        time = calls * (one[in_b] + one[out_b])
        axes = {"ep": AxisTime((ep - 1) / ep * counted, time, time,
                               "between the router, the experts and the combine: all exposed")}
        if edp > 1 and ctx.expert_trainable:
            link = DataParallel.link(ctx)
            if layout.zero_stage:
                axes["edp"] = replica_time(layout, edp, options, ctx.expert, ctx.expert_trainable,
                                           ctx.backward_one, ctx.compute, link)
            else:
                grads = ctx.expert_trainable * options.grad_bytes
                t = ring_time("all_reduce", grads, edp, *link)
                axes["edp"] = AxisTime(2 * (edp - 1) / edp * grads, t, t,
                                       "one flat all-reduce after backward: exposed")
        return axes

    def counted(self, cfg: ModelConfig, layout: Layout, options: TrainingOptions, *, seq_len: int,
                pp_rank: int, layer_ids: list[int]) -> dict[str, tuple[str, str | None, int]]:
        if layout.ep_size == 1 or not cfg.n_experts:
            return {}
        return {"ep_traffic": ("ep", "all_to_all", ep_counted_bytes(cfg, layout, options, seq_len=seq_len,
                                                                    layer_ids=layer_ids))}


def _ep_exchange(cfg: ModelConfig, layout: Layout, options: TrainingOptions,
                 layer_ids: list[int]) -> tuple[int, int, int, int]:
    """(MoE layers, recomputed MoE layers, bytes per element going out, coming back) of a rank holding
    ``layer_ids``: the buffer leaves in the residual stream's dtype and comes back in the compute dtype."""
    ids = moe_layer_ids(cfg, layer_ids)
    recomputed = len(recomputed_layers(layout.activation_checkpointing, layout.checkpoint_every, ids))
    return len(ids), recomputed, 2 if options.precision in ("bf16", "fp16") else 4, \
        4 if options.precision == "fp32" else 2


def ep_counted_bytes(cfg: ModelConfig, layout: Layout, options: TrainingOptions, *, seq_len: int,
                     layer_ids: list[int]) -> int:
    """Bytes a rank holding ``layer_ids`` hands to its ep all-to-alls in one step: what ``comm_bytes/ep/all_to_all``
    counts (the whole buffer per call), 0 without expert parallelism. ``train/plan_check.py`` compares the two."""
    if layout.ep_size == 1 or not cfg.n_experts:
        return 0
    n_moe, recomputed, in_b, out_b = _ep_exchange(cfg, layout, options, layer_ids)
    return all_to_all_bytes(cfg, n_moe_layers=n_moe, micro_batch=layout.micro_batch_size, seq_len=seq_len,
                            n_microbatches=layout.n_microbatches, n_recomputed=recomputed, in_bytes=in_b,
                            out_bytes=out_b)


AXIS = ExpertParallel()
