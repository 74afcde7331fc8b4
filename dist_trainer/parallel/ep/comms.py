"""The expert-parallel token exchanges as autograd Functions (GShard, Lepikhin et al. 2020, section 2.2).

``all_to_all`` sends chunk i of its input (dim 0, equal chunks) to rank i of the ep axis and returns, as chunk j,
what rank j sent: the capacity buffer's exchange. ``all_to_all_uneven`` sends ``send_splits[i]`` rows to rank i
and receives ``recv_splits[j]`` from rank j: the dropless exchange, whose sizes depend on the routing. The backward
of each is the same exchange of the gradient the other way. Every call goes through ``AxisGroup`` and is counted
(op "all_to_all", axis "ep"); an uneven call is charged the rows of this rank's own tokens (what it sends in the
dispatch, what it gets back in the combine, and their gradients), top_k rows per token whatever the routing: the
planner's figure. The rows an expert's rank receives vary with the load (the planner names the worst case).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dist_trainer.parallel.comm import AxisGroup


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_to_all(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_to_all(grad), None


def all_to_all(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Exchange dim-0 chunks over ``group`` (forward and backward); the input itself on a one-rank group."""
    return x if group.size == 1 else _AllToAll.apply(x, group)


def _uneven(x: torch.Tensor, group: AxisGroup, send: list[int], recv: list[int], tokens_in: bool) -> torch.Tensor:
    """One uneven exchange, charged the token side's bytes: the input's when ``tokens_in``, else the output's."""
    rows = sum(send) if tokens_in else sum(recv)
    return group.all_to_all_uneven(x, send, recv, rows * math.prod(x.shape[1:]) * x.element_size())


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, send: list[int], recv: list[int],
                tokens_in: bool) -> torch.Tensor:
        ctx.args = (group, send, recv, tokens_in)
        return _uneven(x, group, send, recv, tokens_in)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, send, recv, tokens_in = ctx.args
        return _uneven(grad, group, recv, send, not tokens_in), None, None, None, None


def all_to_all_uneven(x: torch.Tensor, group: AxisGroup, send_splits: list[int], recv_splits: list[int], *,
                      tokens_in: bool) -> torch.Tensor:
    """Exchange ``send_splits`` rows of ``x`` for ``recv_splits`` rows over ``group`` (forward and backward);
    ``tokens_in``: the input is this rank's tokens' rows (the dispatch), else the output is (the combine)."""
    return x if group.size == 1 else _AllToAllUneven.apply(x, group, send_splits, recv_splits, tokens_in)
