"""Every collective of the project goes through an ``AxisGroup`` and is counted.

An ``AxisGroup`` is one mesh axis (tp, pp, dp; ep and edp under expert parallelism) as seen
from this rank: its process group, size and rank, and the ``CommCounter`` shared by all axes of a ``ParallelState``.
Each call records (op, axis, bytes), where bytes is the size of the buffer this rank
hands to the collective (for all-gather: the local shard; for reduce-scatter: the full
input). That is the figure Megatron's and the ZeRO paper's volume formulas count; the
ring traffic per rank follows from it (all-reduce 2(n-1)/n, gather/scatter (n-1)/n).
Every method returns at once, counting nothing, on a one-rank axis.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (the old name warns); keep both working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommCounter:
    """Bytes and calls per (op, axis) since the last reset."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def record(self, op: str, axis: str, nbytes: int) -> None:
        self.bytes[(op, axis)] += nbytes
        self.calls[(op, axis)] += 1

    def axis_bytes(self, axis: str) -> int:
        return sum(b for (_, a), b in self.bytes.items() if a == axis)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def summary(self) -> dict[str, int]:
        """{"tp/all_reduce": bytes, ...} for logging."""
        return {f"{axis}/{op}": b for (op, axis), b in sorted(self.bytes.items())}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class AxisGroup:
    """One axis of the (dp, pp, tp) grid from this rank's point of view."""

    axis: str  # "tp", "pp", "dp", "ep" (expert-parallel) or "edp" (expert-data-parallel)
    size: int  # ranks along this axis
    rank: int  # this rank's coordinate on the axis
    group: dist.ProcessGroup | None  # None when size == 1 (no process group needed)
    ranks: tuple[int, ...]  # global ranks of the group, in axis order
    counter: CommCounter

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce of ``t``; returns ``t``."""
        if self.size == 1:
            return t
        self.counter.record("all_reduce", self.axis, _nbytes(t))
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (all ranks' shapes equal)."""
        if self.size == 1:
            return t
        self.counter.record("all_gather", self.axis, _nbytes(t))
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        if dim == 0:
            _all_gather_single(out, t, group=self.group)
            return out
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``t`` over the axis and keep this rank's 1/size slice along ``dim``."""
        if self.size == 1:
            return t
        if t.shape[dim] % self.size:
            raise RuntimeError(
                f"reduce_scatter on axis {self.axis}: dim {dim} of shape {tuple(t.shape)} "
                f"is not divisible by the axis size {self.size}"
            )
        self.counter.record("reduce_scatter", self.axis, _nbytes(t))
        parts = [p.contiguous() for p in t.chunk(self.size, dim=dim)]
        out = torch.empty_like(parts[self.rank])
        if dist.get_backend(self.group) == "gloo":  # gloo has no reduce_scatter: all-reduce, keep a slice
            full = torch.cat([p.flatten() for p in parts])
            dist.all_reduce(full, group=self.group)
            out.copy_(full.view(self.size, -1)[self.rank].view_as(out))
        else:
            dist.reduce_scatter(out, parts, group=self.group)
        return out

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """Chunk ``i`` of ``t`` (dim 0 cut into ``size`` equal chunks) goes to axis rank ``i``; chunk ``j`` of the
        result came from axis rank ``j`` (expert parallelism's token exchange). Counts the whole of ``t``."""
        if self.size == 1:
            return t
        if t.shape[0] % self.size:
            raise RuntimeError(f"all_to_all on axis {self.axis}: dim 0 of shape {tuple(t.shape)} is not divisible "
                               f"by the axis size {self.size}")
        self.counter.record("all_to_all", self.axis, _nbytes(t))
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        return out

    def broadcast(self, t: torch.Tensor, src_axis_rank: int = 0) -> torch.Tensor:
        if self.size == 1:
            return t
        self.counter.record("broadcast", self.axis, _nbytes(t))
        dist.broadcast(t, src=self.ranks[src_axis_rank], group=self.group)
        return t

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)
