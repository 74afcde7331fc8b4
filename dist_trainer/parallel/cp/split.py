"""How a sequence is split over the cp ranks, and the seams of the model that follow the split.

Causal models under ring attention split it zigzag: 2 x cp chunks, rank r holding chunks r and 2cp-1-r, so every
rank's queries see about the same number of keys (Megatron-core's ``get_batch_on_this_cp_rank``). Encoders, and
all-to-all attention (where every rank attends the whole sequence with a slice of the heads), split it in cp
contiguous chunks. Positions, the loss's targets and blocks that need the whole sequence follow the same split.
"""

from __future__ import annotations

from typing import Any

import torch

from dist_trainer.model_blocks import Sequence
from dist_trainer.parallel.comm import AxisGroup


def chunk_ids(rank: int, size: int, zigzag: bool) -> tuple[int, ...]:
    """The global chunk indices ``rank`` holds, in the order its local sequence lists them."""
    return (rank, 2 * size - 1 - rank) if zigzag else (rank,)


def local_index(t_full: int, rank: int, size: int, zigzag: bool, device: torch.device) -> torch.Tensor:
    """The global positions of ``rank``'s tokens of a sequence of ``t_full`` tokens, in its local order."""
    n = 2 * size if zigzag else size
    c = t_full // n
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(rank, size, zigzag)])


class ContextParallelSequence(Sequence):
    """This cp rank's part of every sequence (the model's ``sequence`` seam under context parallelism)."""

    def __init__(self, group: AxisGroup, zigzag: bool) -> None:
        super().__init__()
        self.group, self.zigzag = group, zigzag

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (B, T / cp, ...): this rank's tokens (the sequence is dim 1)."""
        t = x.shape[1]
        n = 2 * self.group.size if self.zigzag else self.group.size
        if t % n:
            raise RuntimeError(f"a sequence of {t} tokens does not split into {n} chunks over cp={self.group.size}")
        return x.index_select(1, local_index(t, self.group.rank, self.group.size, self.zigzag, x.device))

    def rows(self, table: torch.Tensor, t: int) -> torch.Tensor:
        """The table's rows at the global positions of this rank's ``t`` tokens."""
        return table.index_select(0, local_index(t * self.group.size, self.group.rank, self.group.size, self.zigzag,
                                                 table.device))

    def order(self, t_full: int, device: torch.device) -> torch.Tensor:
        """For the rank-major concatenation of every rank's tokens (an all-gather), the global position of each."""
        return torch.cat([local_index(t_full, r, self.group.size, self.zigzag, device) for r in range(self.group.size)])


class _GatherSequence(torch.autograd.Function):
    """All ranks' tokens, in sequence order, for a block every cp rank computes whole (a MoE layer routes a
    sequence as one). Backward: each rank's gradient of its own tokens, summed over the ranks' replicas."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seq: ContextParallelSequence) -> torch.Tensor:
        g = seq.group
        parts = g.all_gather(x.transpose(0, 1).contiguous()).transpose(0, 1)  # rank-major along dim 1
        order = seq.order(parts.shape[1], x.device)
        out = torch.empty_like(parts)
        out[:, order] = parts
        ctx.seq, ctx.order = seq, order
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = ctx.seq.group
        rank_major = grad[:, ctx.order].transpose(0, 1).contiguous()
        return g.reduce_scatter(rank_major).transpose(0, 1), None


class _KeepLocal(torch.autograd.Function):
    """This rank's tokens of a whole-sequence output; backward places their gradient, zeros elsewhere (the other
    tokens' gradients are their own ranks' to give, summed by the gather's backward)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, seq: ContextParallelSequence) -> torch.Tensor:
        index = local_index(y.shape[1], seq.group.rank, seq.group.size, seq.zigzag, y.device)
        ctx.index, ctx.length = index, y.shape[1]
        return y.index_select(1, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        full = grad.new_zeros((grad.shape[0], ctx.length, *grad.shape[2:]))
        full[:, ctx.index] = grad
        return full, None


def gather_sequence(x: torch.Tensor, seq: ContextParallelSequence) -> torch.Tensor:
    return _GatherSequence.apply(x, seq)


def keep_local(y: torch.Tensor, seq: ContextParallelSequence) -> torch.Tensor:
    return _KeepLocal.apply(y, seq)
