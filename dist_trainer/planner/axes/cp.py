"""Context parallelism in the planner (its arithmetic: ``planner/cp.py``): ring shifts overlapped with one block
of the attention core each, or the all-to-alls around it, exposed; on the rank with the most layers.
Candidates: cp 1, and each divisor of the ranks TP and PP leave that keeps ``MIN_CP_TOKENS`` of a sequence per
rank (or up to the user's ``max_cp_size``), in both modes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dist_trainer.config import CP_MODES, ModelConfig
from dist_trainer.layout_rules import Layout, divisors
from dist_trainer.planner.activation_spec import recomputed_layers
from dist_trainer.planner.axes.base import AxisEntry, AxisTime, Fields, SearchSpace, StepContext
from dist_trainer.planner.cp import cp_counted_bytes, cp_exposed_seconds, cp_layer_bytes
from dist_trainer.planner.flops import layer_forward_flops_per_token

if TYPE_CHECKING:
    from dist_trainer.planner.options import TrainingOptions

# Context parallelism is searched only while each rank keeps this many tokens of a sequence: below it the ring's
# transfers are no longer hidden behind the attention blocks (Megatron-core recommends cp from 8K tokens up)
MIN_CP_TOKENS = 4096


class ContextParallel(AxisEntry):
    name = "cp"

    def candidates(self, space: SearchSpace, chosen: Mapping[str, Any]) -> list[Fields]:
        ranks, pp = space.n_gpus // chosen["tp_size"], chosen["pp_size"]
        none = {"cp_size": 1, "cp_mode": "ring"}
        if ranks % pp:
            return [none]
        most = space.max_cp_size
        sizes = [c for c in divisors(ranks // pp)
                 if c > 1 and (c <= most if most is not None else space.seq_len // c >= MIN_CP_TOKENS)]
        return [none, *({"cp_size": c, "cp_mode": m} for c in sizes for m in CP_MODES)]

    def time(self, ctx: StepContext) -> dict[str, AxisTime]:
        layout, cfg, hardware = ctx.layout, ctx.cfg, ctx.hardware
        if layout.cp_size == 1:
            return {}
        ids = max(ctx.layers, key=len)
        _, attn = layer_forward_flops_per_token(cfg, ctx.seq_len)
        t, tokens = layout.tp_size, ctx.tokens
        attention_fwd = attn * tokens / t / hardware.matmul_flops(ctx.options.precision, tokens, cfg.d_model / t)
        recomputed = len(ids) if layout.activation_checkpointing == "selective" else len(
            recomputed_layers(layout.activation_checkpointing, layout.checkpoint_every, ids))
        # one layer's bytes, at the compute dtype's activation bytes (as cp_counted_bytes takes them)
        layer = cp_layer_bytes(cfg, layout, seq_len=ctx.seq_len, act_bytes=ctx.act_bytes)
        total, exposed = cp_exposed_seconds(cfg, layout, seq_len=ctx.seq_len, act_bytes=ctx.act_bytes,
                                            layers=len(ids), recomputed=recomputed, attention_fwd_s=attention_fwd,
                                            link=ctx.link(t * layout.cp_size), layer_bytes=layer)
        volume = cp_counted_bytes(cfg, layout, seq_len=ctx.seq_len, precision=ctx.options.precision, layer_ids=ids,
                                  layer_bytes=layer)
        note = ("K/V around the ring, each shift behind one block of the attention core" if layout.cp_mode == "ring"
                else "q, k, v and the output across the group around the attention core: all exposed")
        return {"cp": AxisTime(volume, total, exposed, note)}

    def counted(self, cfg: ModelConfig, layout: Layout, options: TrainingOptions, *, seq_len: int,
                pp_rank: int, layer_ids: list[int]) -> dict[str, tuple[str, str | None, int]]:
        if layout.cp_size == 1:
            return {}
        return {"cp_traffic": ("cp", None, cp_counted_bytes(cfg, layout, seq_len=seq_len, precision=options.precision,
                                                            layer_ids=layer_ids,
                                                            last_stage=pp_rank == layout.pp_size - 1))}


AXIS = ContextParallel()
