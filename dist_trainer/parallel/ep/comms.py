"""The expert-parallel token exchange as an autograd Function (GShard, Lepikhin et al. 2020, section 2.2).

``all_to_all`` sends chunk i of its input (dim 0, equal chunks) to rank i of the ep axis and returns, as chunk j,
what rank j sent. Its backward is the same exchange of the gradient: the chunk a rank received from j goes back
to j. Every call goes through ``AxisGroup.all_to_all`` and is counted (op "all_to_all", axis "ep").
"""

from __future__ import annotations

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
