"""All-to-all attention (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509) over the cp axis.

Around the attention core, one all-to-all each for q, k and v turns this rank's (B, H, T/cp, D) slice of the
sequence into all T tokens of H/cp heads, the usual causal or bidirectional attention runs on them, and one
all-to-all turns the output back (4 N h / cp elements per layer and direction per rank, Ulysses section 3). The
heads (the kv heads under GQA) must split over cp: ``layout_rules.cp`` refuses a layout where they do not.
The sequence is split in cp contiguous chunks, so the gathered tokens are in order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_trainer.model_blocks import SDPAttention
from dist_trainer.parallel.comm import AxisGroup


def _seq_to_heads(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(B, H, T/cp, D) -> (B, H/cp, T, D): head group i goes to cp rank i, rank j's tokens come back in place j."""
    B, H, t, D = x.shape
    chunks = x.reshape(B, group.size, H // group.size, t, D).transpose(0, 1)  # (cp, B, H/cp, t, D)
    out = group.all_to_all(chunks.reshape(group.size * B, H // group.size, t, D))
    return out.reshape(group.size, B, H // group.size, t, D).permute(1, 2, 0, 3, 4).reshape(B, H // group.size,
                                                                                           group.size * t, D)


def _heads_to_seq(y: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(B, H/cp, T, D) -> (B, H, T/cp, D): the inverse of ``_seq_to_heads``."""
    B, h, T, D = y.shape
    t = T // group.size
    chunks = y.reshape(B, h, group.size, t, D).permute(2, 0, 1, 3, 4)  # (cp, B, h, t, D): chunk j to rank j
    out = group.all_to_all(chunks.reshape(group.size * B, h, t, D))
    return out.reshape(group.size, B, h, t, D).transpose(0, 1).reshape(B, group.size * h, t, D)


class _AllToAll(torch.autograd.Function):
    """``forward_fn`` forward, ``backward_fn`` (its inverse) on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)), None, None


class UlyssesAttention(nn.Module):
    """The model's ``attend`` seam under all-to-all context parallelism: the plain core on all tokens of H/cp
    heads."""

    def __init__(self, core: SDPAttention, group: AxisGroup) -> None:
        super().__init__()
        self.core, self.group = core, group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:  # layout_rules.check_cp refuses the models that attend with a mask tensor
            raise ValueError("all-to-all context parallelism attends without an attention mask")
        q, k, v = (_AllToAll.apply(x, self.group, True) for x in (q, k, v))
        # the gathered tokens are the whole sequences in order: a packed batch's (B, T) segment ids apply as they are
        out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents=documents)
        return _AllToAll.apply(out, self.group, False)
