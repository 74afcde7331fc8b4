"""The data-parallel replicas in the planner (every rank holding the same parameters: ``Layout.replicas``), under DDP or
DeepSpeed ZeRO-1/2/3 with or without CPU offload.

Time: DDP all-reduces in 25 MB buckets while the LAST micro-batch's backward produces them (earlier micro-batches
accumulate under no_sync), so only what outlasts that backward, and at least the last bucket, is exposed. The
pipeline engine all-reduces once after the schedule: exposed. ZeRO-1 reduces at the accumulation boundary, ZeRO-2
reduce-scatters every micro-batch's gradients (DeepSpeed's stage-2 hooks), both all-gather the updated partition
after the step; ZeRO-3 gathers every parameter in each micro-batch's forward and backward and reduce-scatters its
gradients (ZeRO, section 7: 3 Psi per micro-batch). DeepSpeed's ``overlap_comm`` (the JSON's value, else on for
CUDA and off for the CPU: ``parallel/zero/config.overlap_comm``) decides what is exposed, as DeepSpeed schedules it:
off, the hooks reduce and gather synchronously: all exposed. On, the gradients are reduce-scattered a
``reduce_bucket_size`` bucket at a time on a side stream while the backward that produces them goes on, so only
what outlasts that backward, and at least the last bucket, is exposed (ZeRO-2 behind every micro-batch's backward,
ZeRO-1 behind the accumulation boundary's); ZeRO-3 gathers ``stage3_prefetch_bucket_size`` of the next modules'
parameters while the current one computes (the first bucket waited for) and shares the backward's link between its
gathers and its reductions. The all-gather of the updated partition after the step is always exposed.
Offload: fp32 gradients to the host and 16-bit parameters back over PCIe (ZeRO-2 moves gradients every
micro-batch), CPU Adam on the node's cores, between backward and the next forward: exposed. ``deepspeed``: what
DeepSpeed's ZeRO step costs over DDP's beyond the traffic (calibrated; 0 for the data-sheet profiles).
Memory: DDP's gradient buckets, DeepSpeed's reduce bucket (two with overlap_comm under ZeRO-1/2), ZeRO-3's gathered
layer and, with overlap_comm, its prefetched parameters (the model states' ZeRO
partitioning is ``memory.model_state_bytes``). Candidates: dp is what the entries before it leave of the world,
with every allowed ZeRO stage (none when dp is 1: nothing to shard) and offload.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
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
        ds = zero_comm(layout, options) if layout.zero_stage else None
        if ds and layout.replicas > 1 and trainable:
            # DeepSpeed allocates the whole reduce bucket (reduce_bucket_size elements) once anything trains;
            # ZeRO-1/2 with overlap_comm double-buffer it (stage_1_and_2.py setup_buckets)
            buffers = 2 if ds.overlap and layout.zero_stage < 3 else 1
            over["zero_reduce_bucket"] = buffers * overheads.zero_bucket_elements * options.grad_bytes
        if layout.zero_stage == 3:
            # DeepSpeed's estimate_zero3_model_states_mem_needs: the largest layer gathered (params + grads).
            over["zero3_gathered_layer"] = rp.largest_layer * (options.param_bytes + options.grad_bytes)
            if ds and ds.overlap and overheads.zero3_prefetch:  # the next modules' parameters, gathered ahead
                over["zero3_prefetch"] = round(min(ds.prefetch_bucket, rp.total * options.param_bytes))
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


@dataclass(frozen=True)
class ZeroComm:
    """How DeepSpeed schedules a ZeRO layout's traffic: ``overlap_comm``, and the buckets it works in (bytes)."""

    overlap: bool
    reduce_bucket: float  # reduce_bucket_size elements x the gradient bytes: one reduce-scatter on the side stream
    prefetch_bucket: float  # stage3_prefetch_bucket_size elements x the parameter bytes: the gathers run ahead


def zero_comm(layout: Layout, options: TrainingOptions) -> ZeroComm:
    """The layout's DeepSpeed settings: the JSON it runs with (the shipped configs/ds one, what ``plan --out``
    writes), ``overlap_comm`` per ``options.device`` where the JSON leaves it out (on for CUDA, off for the CPU:
    ``parallel/zero/config.overlap_comm``), or ``options.zero_overlap_comm`` when set."""
    return _zero_comm(layout.zero_stage, layout.zero_offload, options.device, options.zero_overlap_comm,
                      options.grad_bytes, options.param_bytes)


@functools.cache
def _zero_comm(stage: int, offload: bool, device: str, overlap: bool | None, grad_bytes: int,
               param_bytes: int) -> ZeroComm:
    from dist_trainer.parallel.zero.config import (  # torch-free
        DS_PREFETCH_BUCKET,
        DS_REDUCE_BUCKET,
        default_ds_config_path,
        overlap_comm,
        read_ds_json,
    )

    path = default_ds_config_path(stage, offload)
    # a layout the trainer refuses (ZeRO-1 offload) is priced only to say how close it comes: DeepSpeed's defaults
    zero = (read_ds_json(path).get("zero_optimization") or {}) if path.is_file() else {"stage": stage}
    return ZeroComm(overlap_comm(zero, device)[0] if overlap is None else overlap,
                    int(zero.get("reduce_bucket_size", DS_REDUCE_BUCKET)) * grad_bytes,
                    int(zero.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET)) * param_bytes)


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
        if not options.ddp_overlap:
            return AxisTime(2 * (d - 1) / d * grads, time, time, "one all-reduce after the backward (ddp_overlap "
                            "off): exposed")
        last = ring_time("all_reduce", min(DDP_BUCKET_BYTES, grads), d, *link)
        return AxisTime(2 * (d - 1) / d * grads, time, max(last, time - backward_one),
                        "DDP buckets overlap the last micro-batch's backward, all but the last bucket")
    frac = (d - 1) / d
    gather = ring_time("all_gather", params, d, *link)  # the updated partition (ZeRO-1/2) or one pass (ZeRO-3)
    scatter = ring_time("reduce_scatter", grads, d, *link)
    ds = zero_comm(layout, options)
    # with overlap_comm the backward's last bucket is reduced only after the backward ends
    last_bucket = ring_time("reduce_scatter", min(ds.reduce_bucket, grads), d, *link)
    if layout.zero_stage == 3:
        sent = m * frac * (2 * params + grads)
        time = m * (2 * gather + scatter)
        if not ds.overlap:
            return AxisTime(sent, time, time, "overlap_comm off: gathers and reductions inside the hooks, exposed")
        # per micro-batch: the forward's gathers run a prefetch bucket ahead of the modules that use them (the
        # first bucket waited for), the backward's gathers and its reduce-scatters share the link behind its
        # compute, the last bucket after it
        first = ring_time("all_gather", min(ds.prefetch_bucket, params), d, *link)
        forward_one = backward_one / 2
        exposed = m * (max(first, gather - forward_one) + max(first + last_bucket, gather + scatter - backward_one))
        return AxisTime(sent, time, exposed, "overlap_comm: gathers prefetched behind the compute, reduce buckets "
                        "behind the backward; the first gather and the last bucket exposed")
    reductions = m if layout.zero_stage == 2 else 1
    sent = frac * (reductions * grads + params)
    time = reductions * scatter + gather
    if not ds.overlap:
        return AxisTime(sent, time, time, "overlap_comm off: reductions inside the hooks, then the gather: exposed")
    # ZeRO-2 reduces behind every micro-batch's backward, ZeRO-1 behind the accumulation boundary's
    exposed = reductions * max(last_bucket, scatter - backward_one) + gather
    return AxisTime(sent, time, exposed, "overlap_comm: reduce buckets behind the backward, the last one and the "
                    "gather after the step exposed")

AXIS = DataParallel()
