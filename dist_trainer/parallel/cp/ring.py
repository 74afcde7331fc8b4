"""Ring attention (Liu, Zaharia, Abbeel 2023, arXiv 2310.01889) over the cp axis.

Each rank holds the queries, keys and values of its part of every sequence. The K/V blocks travel around the ring
(rank r sends to r + 1 and receives from r - 1) while each rank attends its queries to the block it holds,
merging the block outputs with their running log-sum-exp; after cp - 1 shifts every query has seen every key.
Causal models split the sequence zigzag (2 x cp chunks, rank r holding chunks r and 2cp-1-r; Megatron's
``get_batch_on_this_cp_rank``) so each rank does the same work: a (query chunk, key chunk) pair is whole when the
key chunk comes first, causal on the diagonal and skipped when it comes after. The core's options hold blockwise
(``Scores``): its score scale, Gemma 2's soft-cap (on each block's scores before the mask, its slope taken in
backward), and a sliding window, whose mask a pair of chunks gets from their global positions; a pair wholly past
the window is skipped like one after the diagonal (the K/V still travel, for the ranks further on). Packed
sequences (``documents``: the (B, T) segment ids of the whole sequences, which every rank holds) mask each pair by
segment too, and a pair whose queries share no segment with its keys is skipped as well.

The backward pass recomputes each block from the saved queries, the output and the log-sum-exp (nothing of size
T x T is kept between the passes), circulating K/V again and, with them, the dK/dV accumulated on the way, which
reach their owner after the last shift. Every shift is issued before the block it overlaps is computed.
Blocks are computed in fp32 with plain matmuls: the kernel is one function (``_block``) a flash kernel could
replace. Attention dropout is refused before launch (``layout_rules.cp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dist_trainer.model_positions import same_document
from dist_trainer.parallel.comm import AxisGroup

Chunks = tuple[int, ...]  # the global chunk indices a rank holds, in the order its sequence lists them


@dataclass(frozen=True)
class RingLayout:
    """Which chunks of the sequence each cp rank holds."""

    size: int
    zigzag: bool  # causal: chunks r and 2cp-1-r; else one contiguous chunk per rank

    def chunks(self, rank: int) -> Chunks:
        return (rank, 2 * self.size - 1 - rank) if self.zigzag else (rank,)


@dataclass(frozen=True)
class Scores:
    """What a block's scores are made of, the attention core's options (``SDPAttention``): the q.k multiplier,
    causality, the sliding window (0: none; query i sees keys j with i - window < j <= i) and the soft-cap (0:
    none; c * tanh(s / c) before the mask, Gemma 2)."""

    scale: float
    causal: bool
    window: int = 0
    softcap: float = 0.0


def _pairs(q_chunks: Chunks, k_chunks: Chunks, scores: Scores, c: int, device: torch.device,
           documents: torch.Tensor | None = None) -> list[tuple[int, int, torch.Tensor | None]]:
    """(query chunk slot, key chunk slot, visible) for every pair of chunks of ``c`` tokens in which some query
    sees some key; ``visible`` is the (c, c) bool mask of the pair ((B, 1, c, c) with ``documents``, the (B, T)
    segment ids of packed sequences), None when every query sees every key. A pair wholly after the query chunk
    (causal), wholly past the window or without a segment in common is skipped: its keys are never computed."""
    pairs = _position_pairs(q_chunks, k_chunks, scores, c, device)
    if documents is None:
        return pairs
    out: list[tuple[int, int, torch.Tensor | None]] = []
    for a, b, visible in pairs:
        qa, kb = q_chunks[a], k_chunks[b]
        same = same_document(documents[:, qa * c:(qa + 1) * c], documents[:, kb * c:(kb + 1) * c]).unsqueeze(1)
        seen = same if visible is None else same & visible
        if bool(seen.any()):
            out.append((a, b, None if bool(seen.all()) else seen))
    return out


def _position_pairs(q_chunks: Chunks, k_chunks: Chunks, scores: Scores, c: int,
                    device: torch.device) -> list[tuple[int, int, torch.Tensor | None]]:
    """``_pairs`` by positions alone (causality and the window)."""
    out: list[tuple[int, int, torch.Tensor | None]] = []
    for a, qa in enumerate(q_chunks):
        for b, kb in enumerate(k_chunks):
            if scores.causal and kb > qa:
                continue
            if scores.window and kb < qa and (qa - kb - 1) * c + 1 >= scores.window:
                continue  # the nearest pair of positions, the query chunk's first and the key chunk's last, too far
            if not (scores.causal and kb == qa) and not (scores.window and kb < qa):
                out.append((a, b, None))
                continue
            query = qa * c + torch.arange(c, device=device)[:, None]
            key = kb * c + torch.arange(c, device=device)[None, :]
            visible = key <= query if scores.causal else torch.ones(c, c, dtype=torch.bool, device=device)
            if scores.window:
                visible = visible & (key > query - scores.window)
            out.append((a, b, None if bool(visible.all()) else visible))
    return out


def _split(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.chunk(n, dim=2))  # (B, H, T, D): the sequence is dim 2


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: each of the (B, Hkv, T, D) heads serves heads / Hkv query heads."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _block(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor | None,
           scores: Scores) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 scores of one (query chunk, key chunk) pair, soft-capped and masked outside ``visible``; and, with a
    soft-cap, d(capped)/d(raw) = 1 - tanh^2 (for backward; computed before the mask, so it is finite)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scores.scale
    slope = None
    if scores.softcap:
        t = torch.tanh(s / scores.softcap)  # the core's softcap: tanh(x / c) * c
        s, slope = t * scores.softcap, 1.0 - t * t
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s, slope


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row that sees no key of a block, or none yet) as 0, so that exp(a - x) is exp(-inf) = 0, not nan."""
    return x.masked_fill(torch.isinf(x), 0.0)


def _shift(group: AxisGroup, tensors: list[torch.Tensor]) -> Any:
    """Start sending ``tensors`` to the next cp rank and receiving the previous one's (counted on the cp axis)."""
    return group.ring_shift(tensors)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup,
                ring: RingLayout, scores: Scores, documents: torch.Tensor | None) -> torch.Tensor:
        heads = q.shape[1]
        qf = q.float()
        q_chunks = ring.chunks(group.rank)
        n = len(q_chunks)
        c = q.shape[2] // n
        qs = _split(qf, n)
        outs = [x.new_zeros(*x.shape[:-1], v.shape[-1]) for x in qs]  # v may be narrower (latent attention)
        lses = [torch.full(x.shape[:-1], float("-inf"), device=x.device) for x in qs]
        kv = [k.contiguous(), v.contiguous()]
        src = group.rank
        for step in range(group.size):
            pending = _shift(group, kv) if step < group.size - 1 else None
            ks, vs = _split(_expand(kv[0], heads).float(), n), _split(_expand(kv[1], heads).float(), n)
            for a, b, visible in _pairs(q_chunks, ring.chunks(src), scores, c, q.device, documents):
                s, _ = _block(qs[a], ks[b], visible, scores)
                lse = torch.logsumexp(s, dim=-1)  # -inf on a row this block hides wholly (sliding window)
                out = torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), vs[b])
                new = torch.logaddexp(lses[a], lse)
                safe = _finite(new)
                outs[a] = outs[a] * torch.exp(lses[a] - safe).unsqueeze(-1) + out * torch.exp(lse - safe).unsqueeze(-1)
                lses[a] = new
            if pending is not None:
                kv = pending.wait()
                src = (src - 1) % group.size
        out = torch.cat(outs, dim=2)
        lse = torch.cat(lses, dim=2)  # finite: every query sees at least itself (or, not causal, every key)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.ring, ctx.scores, ctx.documents = group, ring, scores, documents
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, ring, scores = ctx.group, ctx.ring, ctx.scores
        heads = q.shape[1]
        q_chunks = ring.chunks(group.rank)
        n = len(q_chunks)
        c = q.shape[2] // n
        qs, douts, lses = _split(q.float(), n), _split(dout.float(), n), _split(lse.unsqueeze(-1), n)
        deltas = [d for d in _split((dout.float() * out).sum(-1, keepdim=True), n)]  # rowsum(dO * O)
        dqs = [torch.zeros_like(x) for x in qs]
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
            for a, b, visible in _pairs(q_chunks, ring.chunks(src), scores, c, q.device, ctx.documents):
                s, slope = _block(qs[a], ks[b], visible, scores)
                p = torch.exp(s - lses[a])
                dvs[b] += torch.matmul(p.transpose(-1, -2), douts[a])
                ds = p * (torch.matmul(douts[a], vs[b].transpose(-1, -2)) - deltas[a])
                if slope is not None:  # through the soft-cap (p is 0 where the mask hides a key)
                    ds = ds * slope
                dqs[a] += torch.matmul(ds, ks[b]) * scores.scale
                dks[b] += torch.matmul(ds.transpose(-1, -2), qs[a]) * scores.scale
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
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup, ring: RingLayout,
                   scores: Scores, documents: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, T_local, D) queries, (B, Hkv, T_local, D) keys and (B, Hkv, T_local, Dv) values of this rank's chunks
    -> (B, H, T_local, Dv): attention over the whole sequence (``documents``: the whole sequences' (B, T) segment
    ids, each query attending within its segment)."""
    return _RingAttention.apply(q, k, v, group, ring, scores, documents)
