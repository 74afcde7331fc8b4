"""Ring attention (Liu, Zaharia, Abbeel 2023, arXiv 2310.01889) over the cp axis.

Each rank holds the queries, keys and values of its part of every sequence. The K/V blocks travel around the ring
(rank r sends to r + 1 and receives from r - 1) while each rank attends its queries to the block it holds,
merging the block outputs with their running log-sum-exp; after cp - 1 shifts every query has seen every key.
Causal models split the sequence zigzag (2 x cp chunks, rank r holding chunks r and 2cp-1-r; Megatron's
``get_batch_on_this_cp_rank``) so each rank does the same work: a (query chunk, key chunk) pair is whole when the
key chunk comes first, causal on the diagonal and skipped when it comes after.

The backward pass recomputes each block from the saved queries, the output and the log-sum-exp (nothing of size
T x T is kept between the passes), circulating K/V again and, with them, the dK/dV accumulated on the way, which
reach their owner after the last shift. Every shift is issued before the block it overlaps is computed.
Blocks are computed in fp32 with plain matmuls: the kernel is one function (``_block``) a flash kernel could
replace. Attention dropout is refused before launch (``layout_rules.cp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dist_trainer.parallel.comm import AxisGroup

Chunks = tuple[int, ...]  # the global chunk indices a rank holds, in the order its sequence lists them


@dataclass(frozen=True)
class RingLayout:
    """Which chunks of the sequence each cp rank holds."""

    size: int
    zigzag: bool  # causal: chunks r and 2cp-1-r; else one contiguous chunk per rank

    def chunks(self, rank: int) -> Chunks:
        return (rank, 2 * self.size - 1 - rank) if self.zigzag else (rank,)


def _pairs(q_chunks: Chunks, k_chunks: Chunks, causal: bool) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, diagonal) for every pair that is not fully masked."""
    out = []
    for a, qa in enumerate(q_chunks):
        for b, kb in enumerate(k_chunks):
            if not causal or kb < qa:
                out.append((a, b, False))
            elif kb == qa:
                out.append((a, b, True))
    return out


def _split(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.chunk(n, dim=2))  # (B, H, T, D): the sequence is dim 2


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: each of the (B, Hkv, T, D) heads serves heads / Hkv query heads."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _block(q: torch.Tensor, k: torch.Tensor, diagonal: bool, scale: float) -> torch.Tensor:
    """fp32 scores of one (query chunk, key chunk) pair, masked above the diagonal when ``diagonal``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _shift(group: AxisGroup, tensors: list[torch.Tensor]) -> Any:
    """Start sending ``tensors`` to the next cp rank and receiving the previous one's (counted on the cp axis)."""
    return group.ring_shift(tensors)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup,
                ring: RingLayout, causal: bool) -> torch.Tensor:
        heads, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qf = q.float()
        q_chunks = ring.chunks(group.rank)
        n = len(q_chunks)
        qs = _split(qf, n)
        outs = [torch.zeros_like(c) for c in qs]
        lses = [torch.full(c.shape[:-1], float("-inf"), device=c.device) for c in qs]
        kv = [k.contiguous(), v.contiguous()]
        src = group.rank
        for step in range(group.size):
            pending = _shift(group, kv) if step < group.size - 1 else None
            ks, vs = _split(_expand(kv[0], heads).float(), n), _split(_expand(kv[1], heads).float(), n)
            for a, b, diagonal in _pairs(q_chunks, ring.chunks(src), causal):
                s = _block(qs[a], ks[b], diagonal, scale)
                lse = torch.logsumexp(s, dim=-1)
                out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), vs[b])
                new = torch.logaddexp(lses[a], lse)
                outs[a] = outs[a] * torch.exp(lses[a] - new).unsqueeze(-1) + out * torch.exp(lse - new).unsqueeze(-1)
                lses[a] = new
            if pending is not None:
                kv = pending.wait()
                src = (src - 1) % group.size
        out = torch.cat(outs, dim=2)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.ring, ctx.causal = group, ring, causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, ring, causal = ctx.group, ctx.ring, ctx.causal
        heads, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
        q_chunks = ring.chunks(group.rank)
        n = len(q_chunks)
        qs, douts, lses = _split(q.float(), n), _split(dout.float(), n), _split(lse.unsqueeze(-1), n)
        deltas = [d for d in _split((dout.float() * out).sum(-1, keepdim=True), n)]  # rowsum(dO * O)
        dqs = [torch.zeros_like(c) for c in qs]
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        src = group.rank
        for step in range(group.size):
            pending = _shift(group, kv) if step < group.size - 1 else None
            kr, vr = _expand(kv[0], heads).float(), _expand(kv[1], heads).float()
            ks, vs = _split(kr, n), _split(vr, n)
            dk_rep, dv_rep = torch.zeros_like(kr), torch.zeros_like(vr)
            dks, dvs = _split(dk_rep, n), _split(dv_rep, n)
            for a, b, diagonal in _pairs(q_chunks, ring.chunks(src), causal):
                p = torch.exp(_block(qs[a], ks[b], diagonal, scale) - lses[a])
                dvs[b] += torch.matmul(p.transpose(-1, -2), douts[a])
                ds = p * (torch.matmul(douts[a], vs[b].transpose(-1, -2)) - deltas[a])
                dqs[a] += torch.matmul(ds, ks[b]) * scale
                dks[b] += torch.matmul(ds.transpose(-1, -2), qs[a]) * scale
            group_size = heads // kv[0].shape[1]  # GQA: a kv head's gradient sums its query heads'
            dkv[0] += dk_rep.unflatten(1, (-1, group_size)).sum(2)
            dkv[1] += dv_rep.unflatten(1, (-1, group_size)).sum(2)
            # the accumulators travel with the block they belong to; after the last block they go home
            moved = _shift(group, dkv)
            if pending is not None:
                kv = pending.wait()
                src = (src - 1) % group.size
            dkv = moved.wait()
        dq = torch.cat(dqs, dim=2)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup, ring: RingLayout,
                   causal: bool) -> torch.Tensor:
    """(B, H, T_local, D) queries and (B, Hkv, T_local, D) keys/values of this rank's chunks -> (B, H, T_local, D):
    attention over the whole sequence."""
    return _RingAttention.apply(q, k, v, group, ring, causal)
