"""An estimated step time for one layout: compute + bubble (``compute.py``) + the sum over the axis entries.

Each entry of ``planner/axes/`` prices its own communication per rank and step: what is sent, how long it takes
(ring collectives: an all-reduce moves 2(n-1)/n of the buffer in 2(n-1) latency hops, a gather or scatter
(n-1)/n in n-1) and which part the schedule leaves exposed; its module docstring says what overlaps what. A
blocking call between computations also waits for peers still computing or paused by the scheduler:
``sync_cost`` per call, as calibrated for its group size (``HardwareProfile.collective_sync``; 0 for the
data-sheet profiles). This module names no axis: a new one is a new entry, summed here as the others are.
"""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.planner.activation_offload import activation_offload_time
from dist_trainer.planner.axes import AXES, AxisTime, StepContext, StepTime, ring_time
from dist_trainer.planner.compute import bubble_seconds, compute_seconds, step_model_flops
from dist_trainer.planner.hardware import HardwareProfile
from dist_trainer.planner.memory import (
    DEFAULT_OPTIONS,
    Layout,
    TrainingOptions,
    layout_rank_params,
    rank_expert_trainable,
    rank_trainable,
)
from dist_trainer.planner.optimizer import optimizer_time

__all__ = ["AxisTime", "StepTime", "counted_traffic", "estimate_step_time", "ring_time"]


def estimate_step_time(cfg: ModelConfig, layout: Layout, *, seq_len: int, hardware: HardwareProfile,
                       gpus_per_node: int, options: TrainingOptions = DEFAULT_OPTIONS,
                       n_params_rank: int | None = None, n_trainable_rank: int | None = None,
                       n_expert_rank: int = 0, n_expert_trainable_rank: int | None = None,
                       layers_by_rank: list[list[int]] | None = None,
                       flops: tuple[float, float] | None = None, offloaded: int | None = None) -> StepTime:
    """Compute of the slowest stage, stretched by the bubble, plus each axis entry's exposed communication.
    Gradients, their reductions and the optimizer exist for the ``n_trainable_rank`` trainable parameters only
    (default: those ``options.freeze`` and LoRA leave trainable on pipeline rank 0); ``n_expert_rank`` of the
    rank's parameters (``n_expert_trainable_rank`` trainable) are its experts under expert parallelism.
    ``layers_by_rank``: ``layout.layers_by_rank(cfg)``, when the caller has it (the search prices thousands of
    layouts over a few stage splits); ``flops``: ``step_model_flops`` of the layout, likewise (one per batch and
    recomputation); ``offloaded``: pipeline rank 0's activation bytes offloaded to the host, likewise."""
    model_f, hw_f = step_model_flops(cfg, layout, seq_len=seq_len, options=options) if flops is None else flops
    tokens = layout.rank_tokens(seq_len)  # a micro-batch's tokens on this rank (its share of each where split)
    layers = layout.layers_by_rank(cfg) if layers_by_rank is None else layers_by_rank
    most_layers = max(len(ids) for ids in layers)
    rp = None
    if n_params_rank is None:
        rp = layout_rank_params(cfg, layout, 0)
    n_rank = rp.total if rp is not None else n_params_rank
    expert = rp.expert if rp is not None else n_expert_rank  # this rank's experts (their own groups)
    assert n_rank is not None
    if n_trainable_rank is not None:
        trainable = n_trainable_rank
    else:  # options.freeze and LoRA say which of the counted ones train, as the memory prediction's do
        trainable = rank_trainable(cfg, layout, rp, options, 0) if rp is not None else n_rank
    if n_expert_trainable_rank is not None:
        expert_trainable = n_expert_trainable_rank
    else:
        expert_trainable = rank_expert_trainable(cfg, layout, rp, options, 0) if rp is not None else expert
    compute = compute_seconds(cfg, layout, seq_len=seq_len, hardware=hardware, gpus_per_node=gpus_per_node,
                              options=options, hw_flops=hw_f, most_layers=most_layers, tokens=tokens,
                              trainable=trainable)
    bubble = bubble_seconds(layout, compute, hardware, gpus_per_node)
    ctx = StepContext(cfg, layout, options, hardware, seq_len, gpus_per_node, tokens, layers, most_layers, compute,
                      compute * 2.0 / 3.0 / layout.n_microbatches, n_rank, trainable, expert, expert_trainable)
    axes: dict[str, AxisTime] = {}
    for axis in AXES:
        axes.update(axis.time(ctx))
    axes.update(optimizer_time(ctx))  # an optimizer of whole matrices: its Newton-Schulz and its owners' traffic
    host_link = activation_offload_time(cfg, layout, seq_len=seq_len, options=options, hardware=hardware,
                                      compute=compute, most_layers=most_layers, offloaded=offloaded)
    if host_link is not None:  # saved activations to host memory and back: the host link's, no axis's
        axes["activation_offload"] = host_link
    total = compute + bubble + sum(a.exposed for a in axes.values())
    mfu = model_f / (total * layout.world_size * hardware.peak_flops(options.precision))
    return StepTime(compute=compute, bubble=bubble, axes=axes, total=total, model_flops=model_f, mfu=mfu)


def counted_traffic(cfg: ModelConfig, layout: Layout, options: TrainingOptions, *, seq_len: int,
                    pp_rank: int) -> dict[str, tuple[str, str | None, int]]:
    """The traffic the planner counts exactly, for every run's plan check (``train/plan_check.py``): figure ->
    (axis, op or None for all of the axis's, bytes that pipeline rank hands to it in one step's forward and
    backward, as its ``AxisGroup`` counts them). Each entry's own (``Axis.counted``), in the entries' order."""
    ids = layout.rank_layer_ids(cfg, pp_rank)
    out: dict[str, tuple[str, str | None, int]] = {}
    for axis in AXES:
        out.update(axis.counted(cfg, layout, options, seq_len=seq_len, pp_rank=pp_rank, layer_ids=ids))
    return out
