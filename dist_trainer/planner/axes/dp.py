"""The data-parallel replicas in the planner (every rank holding the same parameters: ``Layout.replicas``), under DDP or
DeepSpeed ZeRO-1/2/3 with or without CPU offload.

Time: DDP all-reduces in 25 MB buckets while the LAST micro-batch's backward produces them (earlier micro-batches
accumulate under no_sync), so only what outlasts that backward, and at least the last bucket, is exposed. The
pipeline engine all-reduces once after the schedule: exposed. ZeRO-1 reduces at the accumulation boundary, ZeRO-2
reduce-scatters every micro-batch's gradients (DeepSpeed's stage-2 hooks), both all-gather the updated partition
after the step; ZeRO-3 gathers every parameter in each micro-batch's forward and backward and reduce-scatters its
gradients (ZeRO, section 7: 3 Psi per micro-batch). With DeepSpeed's ``overlap_comm`` (read from the JSON the run
uses) the reductions overlap the backward that produces them and ZeRO-3's prefetch hides gathers behind the
previous module's compute; without it they run inside the hooks: exposed. The all-gather after the step always is.
Offload: fp32 gradients to the host and 16-bit parameters back over PCIe (ZeRO-2 moves gradients every
micro-batch), CPU Adam on the node's cores, between backward and the next forward: exposed. ``deepspeed``: what
DeepSpeed's ZeRO step costs over DDP's beyond the traffic (calibrated; 0 for the data-sheet profiles).
Memory: DDP's gradient buckets, DeepSpeed's reduce bucket and ZeRO-3's gathered layer (the model states' ZeRO
partitioning is ``memory.model_state_bytes``). Candidates: dp is what the entries before it leave of the world,
with every allowed ZeRO stage (none when dp is 1: nothing to shard) and offload.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import Layout
from dist_trainer.planner.axes.base import (
    AxisEntry,
    AxisTime,
    Fields,
    SearchSpace,
    StepContext,
    placed_ranks,
    ring_time,
)

if TYPE_CHECKING:
    from dist_trainer.planner.options import Overheads, TrainingOptions
    from dist_trainer.planner.rank_params import RankParams

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


class DataParallel(AxisEntry):
    name = "dp"

    def candidates(self, space: SearchSpace, chosen: Mapping[str, Any]) -> list[Fields]:
        placed = placed_ranks(chosen)
        if space.n_gpus % placed:
            return []
        dp = space.n_gpus // placed
        return [{"dp_size": dp, "zero_stage": z, "zero_offload": off} for z in space.zero_stages
                if not (z > 0 and dp == 1)
                for off in ((False, True) if z > 0 and space.allow_offload else (False,))]

    def memory(self, cfg: ModelConfig, layout: Layout, rp: RankParams, *, seq_len: int, options: TrainingOptions,
               overheads: Overheads, trainable: int, expert: int) -> dict[str, int]:
        over: dict[str, int] = {}
        if layout.replicas > 1 and layout.zero_stage == 0 and overheads.ddp_grad_buckets:
            over["ddp_grad_buckets"] = (trainable - expert) * options.grad_bytes  # DDP buckets what it reduces
        if layout.replicas > 1 and layout.zero_stage > 0 and trainable:
            # DeepSpeed allocates the whole reduce bucket (reduce_bucket_size elements) once anything trains
            over["zero_reduce_bucket"] = overheads.zero_bucket_elements * options.grad_bytes
        if layout.zero_stage == 3:
            # DeepSpeed's estimate_zero3_model_states_mem_needs: the largest layer gathered (params + grads).
            over["zero3_gathered_layer"] = rp.largest_layer * (options.param_bytes + options.grad_bytes)
        return over

    def time(self, ctx: StepContext) -> dict[str, AxisTime]:
        layout, options, hardware = ctx.layout, ctx.options, ctx.hardware
        axes: dict[str, AxisTime] = {}
        if layout.replicas > 1:
            # over every replica (dp and the ranks splitting a sample: their average per rank)
            axes["dp"] = replica_time(layout, layout.replicas, options, ctx.n_rank - ctx.expert,
                                      ctx.trainable - ctx.expert_trainable, ctx.backward_one, ctx.compute,
                                      self.link(ctx))
        if layout.zero_offload:
            # the optimizer's part: dense over dp, this rank's experts over edp (DeepSpeed's MoE groups)
            r, m = layout.replicas, layout.n_microbatches
            shard = (ctx.trainable - ctx.expert_trainable) / r + ctx.expert_trainable * layout.ep_size / r
            per_micro = m if layout.zero_stage == 2 else 1  # stage 2 moves every micro-batch's gradient partition
            transfer = shard * (4 * per_micro + options.param_bytes) / hardware.pcie_bw
            adam = shard * min(ctx.gpus_per_node, layout.world_size) / hardware.host_adam_params_per_s
            axes["offload"] = AxisTime(shard * (4 * per_micro + options.param_bytes), transfer + adam,
                                       transfer + adam, "between backward and the next forward: exposed")
        if layout.zero_stage and (extra := hardware.zero_step_overhead(layout.zero_stage, ctx.trainable,
                                                                       layout.n_microbatches)):
            axes["deepspeed"] = AxisTime(0.0, extra, extra, "DeepSpeed's step over DDP's beyond the traffic "
                                         "(calibrated)")
        return axes

    @staticmethod
    def link(ctx: StepContext) -> tuple[float, float]:
        """The replicas' link: the network as soon as the world spans nodes."""
        return ctx.inter if ctx.layout.world_size > ctx.gpus_per_node else ctx.intra


def zero_overlap_comm(layout: Layout, options: TrainingOptions) -> bool:
    """DeepSpeed's overlap_comm for this layout: the option, else the shipped configs/ds JSON (what plan writes)."""
    if options.zero_overlap_comm is not None:
        return options.zero_overlap_comm
    return _shipped_overlap_comm(layout.zero_stage, layout.zero_offload)


@functools.cache
def _shipped_overlap_comm(stage: int, offload: bool) -> bool:
    from dist_trainer.parallel.zero.config import default_ds_config_path, read_ds_json  # torch-free

    path = default_ds_config_path(stage, offload)
    if not path.is_file():  # a layout the trainer refuses (ZeRO-1 offload) priced only to say how close it comes
        return False
    zero = read_ds_json(path).get("zero_optimization")
    return bool((zero or {}).get("overlap_comm", False))


def replica_time(layout: Layout, d: int, options: TrainingOptions, n_rank: int, trainable: int,
                 backward_one: float, compute: float, link: tuple[float, float]) -> AxisTime:
    """The gradients' reduction over ``d`` replicas in one step (module docstring): volume per regime and what
    overlaps it. Gradients and ZeRO-1/2's updated partitions are the trainable parameters'; ZeRO-3
    gathers every parameter for use. The ep entry prices the experts' (over edp) with it too."""
    m = layout.n_microbatches
    grads = trainable * options.grad_bytes
    params = (n_rank if layout.zero_stage == 3 else trainable) * options.param_bytes
    if layout.zero_stage == 0:
        time = ring_time("all_reduce", grads, d, *link)
        if layout.pp_size > 1:
            return AxisTime(2 * (d - 1) / d * grads, time, time, "one flat all-reduce after the schedule: exposed")
        last = ring_time("all_reduce", min(DDP_BUCKET_BYTES, grads), d, *link)
        return AxisTime(2 * (d - 1) / d * grads, time, max(last, time - backward_one),
                        "DDP buckets overlap the last micro-batch's backward, all but the last bucket")
    frac = (d - 1) / d
    gather = ring_time("all_gather", params, d, *link)  # the updated partition (ZeRO-1/2) or one pass (ZeRO-3)
    scatter = ring_time("reduce_scatter", grads, d, *link)
    overlap = zero_overlap_comm(layout, options)
    if layout.zero_stage == 3:
        sent = m * frac * (2 * params + grads)
        time = m * (2 * gather + scatter)
        if not overlap:
            return AxisTime(sent, time, time, "overlap_comm off: gathers and reductions inside the hooks, exposed")
        exposed = max(0.0, m * 2 * gather - compute) + max(0.0, m * scatter - compute * 2 / 3)
        return AxisTime(sent, time, exposed, "overlap_comm: prefetched gathers and reductions behind compute")
    reductions = m if layout.zero_stage == 2 else 1
    sent = frac * (reductions * grads + params)
    time = reductions * scatter + gather
    if not overlap:
        return AxisTime(sent, time, time, "overlap_comm off: reductions inside the hooks, then the gather: exposed")
    window = backward_one * reductions
    return AxisTime(sent, time, max(0.0, reductions * scatter - window) + gather,
                    "overlap_comm: reductions behind the backward; the gather after the step exposed")


AXIS = DataParallel()
