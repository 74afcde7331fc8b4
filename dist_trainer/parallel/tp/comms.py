"""The tensor-parallel communication operators, as autograd Functions.

Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053, section 3) names two conjugate
operators: ``f`` (identity forward, all-reduce backward) enters a tensor-parallel
region, ``g`` (all-reduce forward, identity backward) leaves it. Sequence parallelism
(Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2) replaces them by an
all-gather / reduce-scatter pair along the sequence dimension, so that the code
between two TP regions (norms, dropout, residual adds) runs on 1/t of the sequence.

Every operator takes the ``AxisGroup`` explicitly (no global group), goes through its
counted collectives, and returns its input unchanged on a one-rank group. Activations
are laid out (B, T, C) in this project, so the sequence dimension is 1.
"""

from __future__ import annotations

from typing import Any

import torch

from dist_trainer.parallel.comm import AxisGroup

SEQ_DIM = 1  # activations are (B, T, C)


def _split(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    """This rank's contiguous 1/size slice of ``x`` along ``dim`` (no communication)."""
    if x.shape[dim] % group.size:
        raise RuntimeError(
            f"cannot split dim {dim} of shape {tuple(x.shape)} over {group.size} {group.axis} ranks: "
            f"{x.shape[dim]} is not divisible by {group.size}"
        )
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """``f``: forward identity, backward all-reduce (sum) over the TP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Clone: autograd may hand the same gradient buffer to several consumers (e.g. an
        # identity residual branch), so an in-place all-reduce could corrupt a sibling's.
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    """``g``: forward all-reduce (sum) over the TP group, backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        # Clone so the input (a partial sum autograd may still hold) is not modified in place.
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """A statistic every TP rank needs whole (the sum of squares of a norm over split features): forward
    all-reduce (sum), backward all-reduce (sum). Each rank's output depends on the total, so the gradient of the
    total is the sum of what every rank's output sends back, and each rank's own part receives all of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class _GatherFromSequence(torch.autograd.Function):
    """SP entry: forward all-gather along the sequence dim, backward reduce-scatter along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(x, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.reduce_scatter(grad, dim=SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """SP exit: forward reduce-scatter along the sequence dim, backward all-gather along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return group.reduce_scatter(x, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad, dim=SEQ_DIM), None


class _ScatterToSequence(torch.autograd.Function):
    """Split a replicated activation into sequence shards: forward split (no communication),
    backward all-gather along the sequence dim. Used after the embedding sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return _split(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad, dim=SEQ_DIM), None


class _GatherAlong(torch.autograd.Function):
    """Shards -> the full tensor along ``dim``: forward all-gather, backward this rank's slice. Column-parallel
    ``gather_output`` (the last dim), and the sequence for a block every TP rank computes in full (MoE)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return group.all_gather(x, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.group, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    """Row-parallel input that is not yet split: forward split along the last dim,
    backward all-gather along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return _split(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad, dim=grad.dim() - 1), None


def copy_to_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """``f`` (Megatron section 3): identity forward, all-reduce backward."""
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """``g`` (Megatron section 3): all-reduce forward, identity backward."""
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def sum_over_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """The sum of every TP rank's ``x`` on each rank: all-reduce forward, all-reduce backward."""
    return x if group.size == 1 else _SumOverTP.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """SP entry, Korthikanti's ``g`` (section 4.2.2): all-gather along T forward, reduce-scatter backward."""
    return x if group.size == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """SP exit, Korthikanti's ``g-bar`` (section 4.2.2): reduce-scatter along T forward, all-gather backward."""
    return x if group.size == 1 else _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Replicated -> this rank's sequence shard: split forward, all-gather backward."""
    return x if group.size == 1 else _ScatterToSequence.apply(x, group)


def gather_sequence_for_replicated(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """SP shards -> the full sequence for a replicated block: all-gather along T forward, split backward. Pair it
    with ``scatter_to_sequence`` on the block's output (split forward, all-gather backward)."""
    return x if group.size == 1 else _GatherAlong.apply(x, group, SEQ_DIM)


def gather_from_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Last-dim shards -> full tensor: all-gather forward, split backward."""
    return x if group.size == 1 else _GatherAlong.apply(x, group, x.dim() - 1)


def scatter_to_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Full tensor -> this rank's last-dim shard: split forward, all-gather backward."""
    return x if group.size == 1 else _ScatterToTP.apply(x, group)


def enter_tp_region(x: torch.Tensor, group: AxisGroup, sequence_parallel: bool) -> torch.Tensor:
    """Input of a column-parallel region: ``f`` on a replicated input, the sequence
    all-gather on a sequence-sharded one (SP). Applied once per region, so q/k/v (or
    up/gate) share one collective and their input gradients sum locally before it."""
    return gather_from_sequence(x, group) if sequence_parallel else copy_to_tp(x, group)


def exit_tp_region(x: torch.Tensor, group: AxisGroup, sequence_parallel: bool) -> torch.Tensor:
    """Output of a row-parallel region: ``g``, or the sequence reduce-scatter under SP."""
    return reduce_scatter_to_sequence(x, group) if sequence_parallel else reduce_from_tp(x, group)
