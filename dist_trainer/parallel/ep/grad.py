"""Expert gradients: reduced over the expert-data-parallel group, scaled as the dense ones.

After backward an expert's gradient on a rank sums the contributions of the tokens every rank of its ep group
sent it; the dp / ep ranks holding the same experts (edp) saw different tokens. Summing over edp therefore
covers every dp rank's tokens once, and dividing by dp_size gives the mean over the data-parallel batch, the
dense parameters' DDP average (DeepSpeed's ``_reduce_expert_gradients`` divides by the dp world size too).
"""

from __future__ import annotations

import torch
from torch import nn

from dist_trainer.parallel.ep.apply import is_expert_param
from dist_trainer.parallel.state import ParallelState


def expert_param_names(model: nn.Module) -> list[str]:
    """Names of ``model``'s expert-parallel parameters (what DDP must leave alone)."""
    return [n for n, p in model.named_parameters() if is_expert_param(p)]


def split_expert_grads(params: list[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(dense gradients, expert gradients) of ``params`` that have one."""
    dense = [p.grad for p in params if p.grad is not None and not is_expert_param(p)]
    expert = [p.grad for p in params if p.grad is not None and is_expert_param(p)]
    return dense, expert


def reduce_expert_grads(model: nn.Module, state: ParallelState) -> None:
    """Sum the expert gradients over edp (one flat all-reduce) and divide by dp_size, then average them over the
    replica axes after dp (their ranks saw other tokens of the same samples). No-op at ep_size 1."""
    if state.ep.size == 1:
        return
    _, grads = split_expert_grads(list(model.parameters()))
    state.edp.all_reduce_flat_(grads, divide_by=state.dp_size)
    for axis in state.expert_replicas[1:]:
        axis.all_reduce_flat_(grads, divide_by=axis.size)
