"""Pipeline parallelism in the planner: the activation forward and its gradient backward per micro-batch and
stage boundary (b s h / t under SP, and with Megatron's scatter-gather, ``TrainingOptions.pp_scatter_gather``:
each TP rank sends 1/t and the next stage all-gathers it inside its node). A stage cannot start a micro-batch
before its input arrives: the transfers on the critical path, 2 (m v + p - 1), are exposed; the rest overlap other
micro-batches' compute. (The bubble is the step's own term: ``flops.pipeline_bubble``.) Candidates: the divisors
of the ranks TP leaves, each with every allowed schedule (two model chunks per rank for the multi-stage ones);
memory: the receive buffers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import MULTI_STAGE_SCHEDULES, Layout, divisors
from dist_trainer.planner.axes.base import AxisEntry, AxisTime, Fields, SearchSpace, StepContext, ring_time

if TYPE_CHECKING:
    from dist_trainer.planner.options import Overheads, TrainingOptions
    from dist_trainer.planner.rank_params import RankParams


class PipelineParallel(AxisEntry):
    name = "pp"

    def candidates(self, space: SearchSpace, chosen: Mapping[str, Any]) -> list[Fields]:
        sizes = [space.pp_size] if space.pp_size else divisors(space.n_gpus // chosen["tp_size"])
        return [{"pp_size": p} for p in sizes]

    def variants(self, space: SearchSpace, layout: Layout) -> list[Fields]:
        """(schedule, virtual stages): one chunk per rank, or two for the multi-stage (interleaved) ones; whether
        each runs is layout_rules' answer."""
        if layout.pp_size == 1:
            return [{"pp_schedule": "1f1b", "pp_virtual_stages": 1}]
        return [{"pp_schedule": s, "pp_virtual_stages": 2 if s in MULTI_STAGE_SCHEDULES else 1}
                for s in space.pp_schedules]

    def memory(self, cfg: ModelConfig, layout: Layout, rp: RankParams, *, seq_len: int, options: TrainingOptions,
               overheads: Overheads, trainable: int, expert: int) -> dict[str, int]:
        if layout.pp_size == 1:
            return {}
        # receive buffers for the activation (forward) and its gradient (backward); the residual stream crosses
        # stages in the parameters' dtype (fp32 under autocast: 16-bit only for 16-bit models)
        spec_rep = 1 / layout.tp_size if layout.sequence_parallel else 1
        elem = 2 if options.precision in ("bf16", "fp16") else 4
        return {"pp_p2p_buffers": round(2 * layout.micro_batch_size * seq_len * cfg.d_model * spec_rep * elem)}

    def time(self, ctx: StepContext) -> dict[str, AxisTime]:
        layout = ctx.layout
        p, m, v = layout.pp_size, layout.n_microbatches, layout.pp_virtual_stages
        if p == 1:
            return {}
        t = layout.tp_size
        bsh = ctx.tokens * ctx.cfg.d_model * ctx.act_bytes
        link = ctx.link(t * p)
        critical = 2 * (m * v + p - 1)
        if layout.sequence_parallel or (ctx.options.pp_scatter_gather and t > 1):
            msg = bsh / t  # each TP rank's shard; scatter-gather re-gathers it on the node's link
            gather = 0.0 if layout.sequence_parallel else ring_time("all_gather", bsh, t, *ctx.intra)
        else:
            msg, gather = bsh, 0.0
        one = ring_time("p2p", msg, 2, *link) + gather + ctx.hardware.sync_cost(2, ctx.compute / (2 * m * v))
        return {"pp": AxisTime(2 * m * v * msg, 2 * m * v * one, critical * one,
                               f"the {critical} transfers on the schedule's critical path are exposed")}


AXIS = PipelineParallel()
