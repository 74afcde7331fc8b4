"""Which elements of each full parameter this rank owns: the pieces that statistics are summed over.

A statistic of the full model (a sum of squares, an L1 distance, a histogram count) is a sum over
elements, so each rank sums over the elements it owns and one all-reduce per mesh axis adds the ranks up.
The pieces of all ranks partition every full parameter exactly once, whatever the layout:

- tensor parallelism: a TP-split parameter's shard on every TP rank (vocabulary padding rows left out);
  a TP-replicated parameter on TP rank 0 only (Megatron's ``param_is_not_tensor_parallel_duplicate``);
- pipeline stages: each stage's own parameters; the tied head copy on the last stage is left out
  (``pp_shared_copy``: its value and, after the tied-gradient sum, its gradient equal stage 0's);
- data parallelism: replicas hold the same values, so each DP rank owns a 1/dp slice of every piece
  (``tensor_split`` of the flat tensor): a copy kept per piece then costs 1/dp of the replica's bytes;
- expert parallelism: an expert (``ep_expert``, parallel/ep/) is held by the dp / ep ranks of one
  expert-data-parallel group only, so each of them owns a 1/edp slice of it, and every expert is counted once
  over the dp axis (the ep ranks of a group hold different experts);
- ZeRO: DeepSpeed's own partitions (``parallel/zero/fragments.py``).

``offset`` is where the piece starts in the flattened full parameter, when the piece is contiguous there
(None for a split along a later dim): it lets a sample of embedding rows be assembled from pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dist_trainer.parallel.state import ParallelState


@dataclass
class Piece:
    """The elements of parameter ``name`` this rank owns, as flat views (no copies)."""

    name: str
    param: torch.Tensor  # flat view of the owned values
    grad: torch.Tensor | None  # flat view of their gradient (None when the parameter has none)
    offset: int | None  # position of param[0] in the flattened full parameter, or None


def unique_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters`` with a tied weight once, under its first name."""
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def counted_on_this_tp_rank(p: torch.Tensor, state: ParallelState) -> bool:
    """A TP-split parameter counts on every TP rank (its shard), a replicated one on TP rank 0 only."""
    return hasattr(p, "tp_split_dim") or state.tp.rank == 0


def dense_pieces(model: nn.Module, state: ParallelState) -> list[Piece]:
    """This rank's pieces of a model whose parameters are whole or TP shards (DDP, TP, pipeline stages)."""
    pieces = []
    for name, p in unique_named_parameters(model):
        if getattr(p, "pp_shared_copy", False) or not counted_on_this_tp_rank(p, state):
            continue
        numel, start = tp_shard_extent(p, state)
        flat = p.detach().reshape(-1)[:numel]
        grad = None if p.grad is None else p.grad.detach().reshape(-1)[:numel]
        # the replicas that hold it: the replica axes, or for an expert its edp group and the replica axes after dp
        rank, size = state.replica_coordinate(expert=getattr(p, "ep_expert", False))
        lo, hi = numel * rank // size, numel * (rank + 1) // size
        pieces.append(Piece(name, flat[lo:hi], None if grad is None else grad[lo:hi],
                            None if start is None else start + lo))
    return pieces


def tp_shard_extent(p: torch.Tensor, state: ParallelState) -> tuple[int, int | None]:
    """(elements of this rank's TP shard that belong to the full parameter, the shard's start in the full
    flattened parameter or None when a split along a later dim makes it not contiguous there). The shard's
    shape is DeepSpeed's ``ds_shape`` when ZeRO-3 has partitioned it away."""
    shape = tuple(getattr(p, "ds_shape", p.shape))
    numel = math.prod(shape)
    dim = getattr(p, "tp_split_dim", None)
    if dim is None:
        return numel, 0
    if dim != 0:
        return numel, None
    rows, row = shape[0], math.prod(shape[1:])
    start_row = rows * state.tp.rank
    full = getattr(p, "tp_full_size", rows * state.tp.size)
    return max(0, min(rows, full - start_row)) * row, start_row * row
