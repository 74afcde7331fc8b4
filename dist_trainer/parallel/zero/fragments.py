"""This rank's pieces of DeepSpeed's ZeRO partitions, and how to make DeepSpeed skip one step.

Pieces (``parallel/ownership.Piece``): under ZeRO each DP rank owns a slice of the fp32 master weights and
of the reduced gradient, and the slices partition every parameter exactly once, so statistics summed over
them and reduced over dp are the full parameter's (issue 13). They are read through DeepSpeed's fragment
mapping, the same objects its ``safe_get_full_fp32_param`` / ``safe_get_full_grad`` assemble from
(deepspeed/utils/tensor_fragment.py), without their per-parameter all-reduce or all-gather:

- stages 1 and 2: ``param._hp_mapping`` (None when none of the parameter is in this rank's partition):
  the fp32 fragment, its gradient fragment and its start ``lp_fragment_address.start`` in the flat parameter;
- stage 3: ``_z3_optimizer.get_local_fp32_param`` / ``get_local_fp32_grad_for_param``: rank r holds
  elements [r * n, (r + 1) * n) of the flat parameter, the last rank's tail being padding (left out).

Gradients are read between the last backward of a step and ``engine.step()``, where DeepSpeed's documentation
places ``safe_get_full_grad`` too.

Skipping a step: DeepSpeed skips a step whose gradient norm is not finite (``overflow``: it clears the
gradients, counts ``skipped_steps`` and keeps its micro-step and global-step counters consistent; stage 1/2
``step``, stage 3 ``_overflow_check_and_loss_scale_update``). ``skip_next_step`` puts a NaN into one gradient
element this rank owns, so the step the trainer decided not to apply goes down that same path.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dist_trainer.parallel.ownership import Piece, counted_on_this_tp_rank, tp_shard_extent, unique_named_parameters
from dist_trainer.parallel.state import ParallelState


def _stage12_piece(name: str, p: Any, grads: bool) -> Piece | None:
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    address = mapping.lp_fragment_address
    param = mapping.get_hp_fragment().reshape(-1)
    grad = None
    if grads and getattr(p, "_index_in_param_group", None) is not None:
        grad = mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
        if grad is not None and grad.numel() == p.numel() and address.numel != p.numel():
            grad = grad.narrow(0, address.start, address.numel)  # bf16 keeps a full buffer (get_full_hp_grad)
    return Piece(name, param, grad, address.start)


def _stage3_piece(name: str, p: Any, grads: bool) -> Piece | None:
    optimizer = p._z3_optimizer
    param = optimizer.get_local_fp32_param(p).reshape(-1)
    n = param.numel()
    start = optimizer._get_param_partition_rank(p) * n
    valid = max(0, min(n, p.ds_numel - start))
    grad = None
    if grads:
        grad = optimizer.get_local_fp32_grad_for_param(p).reshape(-1)[:valid]
    return Piece(name, param[:valid], grad, start)


def zero_pieces(model: nn.Module, state: ParallelState, stage: int, grads: bool = True) -> list[Piece]:
    """This rank's pieces of every trainable parameter's fp32 master weight (and, with ``grads``, of its reduced
    gradient: only between the last backward of a step and ``engine.step()``).

    DeepSpeed partitions each rank's TP shard over dp, so a piece's place in the shard is also cut to the shard's
    real elements (vocabulary padding rows left out) and moved to its place in the full parameter; the tied head
    copy of a pipeline's last stage is left out, as ``dense_pieces`` leaves it."""
    pieces = []
    for name, p in unique_named_parameters(model):
        if not p.requires_grad or getattr(p, "pp_shared_copy", False) or not counted_on_this_tp_rank(p, state):
            continue
        piece = _stage3_piece(name, p, grads) if stage == 3 else _stage12_piece(name, p, grads)
        if piece is None or piece.offset is None:
            continue
        valid, shard_start = tp_shard_extent(p, state)
        keep = max(0, min(piece.param.numel(), valid - piece.offset))
        if keep:
            pieces.append(Piece(name, piece.param[:keep], None if piece.grad is None else piece.grad[:keep],
                                None if shard_start is None else shard_start + piece.offset))
    return pieces


def skip_next_step(model: nn.Module, state: ParallelState, stage: int) -> None:
    """Make the coming ``engine.step()`` skip: a NaN in a gradient element this rank owns (every rank calls
    it; DeepSpeed reduces the gradient norm over dp, so one rank's NaN would do)."""
    for piece in zero_pieces(model, state, stage):
        if piece.grad is not None and piece.grad.numel():
            piece.grad[0] = float("nan")
            return

