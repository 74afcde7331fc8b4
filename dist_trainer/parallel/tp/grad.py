"""Gradient steps that tensor parallelism adds between backward and the optimizer step.

``finalize_tp_grads``: parameters replicated on every TP rank but fed only a part of the
work (sequence-parallel norms and row-parallel biases, replicated GQA k/v projections;
flagged ``p.tp_reduce_grad``) hold partial gradients after backward; one flat all-reduce
over TP sums them (Megatron-core's ``finalize_model_grads`` does the same for its
sequence-parallel parameters).

``sum_partial_grads_in_backward``: the same sum, made inside backward by a leaf tensor hook on each such
parameter, for an optimizer that takes ``.grad`` away in its own backward hooks (DeepSpeed ZeRO-2/3 reduce
and free it in post-accumulate hooks, so a sum after backward would come too late).

``clip_grad_norm_``: the global 2-norm over every rank's shards, counting a TP-sharded
parameter's shards once each and a TP-replicated parameter once (on TP rank 0 only,
Megatron's ``param_is_not_tensor_parallel_duplicate``), reduced over TP and PP. DP ranks
hold identical gradients after DDP's all-reduce, so DP is not reduced; expert-parallel experts
(``p.ep_expert``, parallel/ep/) differ across the ep group, so their part is summed over it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from dist_trainer.parallel.state import ParallelState


def _params(params_or_model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    params = params_or_model.parameters() if isinstance(params_or_model, nn.Module) else params_or_model
    return list({id(p): p for p in params}.values())  # a tied weight once


def finalize_tp_grads(model: nn.Module, state: ParallelState) -> None:
    """Sum the partial gradients of ``tp_reduce_grad`` parameters over TP, in one all-reduce.

    Call after backward (after DDP's gradient all-reduce) and before clipping. No-op at tp=1.
    """
    if state.tp.size == 1:
        return
    state.tp.all_reduce_flat_([p.grad for p in _params(model)
                               if getattr(p, "tp_reduce_grad", False) and p.grad is not None])


def _square_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    # per-tensor norms (no squared temporaries), as torch.nn.utils.clip_grad_norm_ computes them
    norms = [torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32) for g in grads]
    return torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float32, device=device)


def sum_partial_grads_in_backward(model: nn.Module, state: ParallelState) -> int:
    """Register a tensor hook on every ``tp_reduce_grad`` parameter that returns the TP sum of its gradient;
    return how many were hooked. No-op at tp=1.

    A leaf tensor hook (``Parameter.register_hook``) runs before AccumulateGrad adds the gradient to
    ``.grad``, so each backward's contribution is summed over TP exactly once, whatever happens to ``.grad``
    afterwards: post-accumulate hooks (DeepSpeed ZeRO-2/3's reductions, deepspeed/utils/torch.py
    register_grad_hook) then see the summed gradient, and with gradient accumulation the running total is never
    summed twice (a post-accumulate all-reduce of ``.grad`` would be, under ZeRO-1 which keeps ``.grad`` until
    the step). Every TP rank runs the same graph, so the all-reduces meet in the same order. Register after
    ``apply_tensor_parallel`` (it replaces the Parameters) and instead of, not with, ``finalize_tp_grads``.
    """
    if state.tp.size == 1:
        return 0
    group = state.tp
    hooked = 0
    for p in _params(model):
        if getattr(p, "tp_reduce_grad", False):
            p.register_hook(lambda g: group.all_reduce(g.detach().clone()))
            hooked += 1
    return hooked


def clip_grad_norm_(params_or_model: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    state: ParallelState) -> torch.Tensor:
    """Scale gradients in place so that their global 2-norm is at most ``max_norm``.

    Returns the norm before clipping (fp32 scalar), the same on every rank. Matches
    ``torch.nn.utils.clip_grad_norm_`` on the single-process model: coefficient
    max_norm / (norm + 1e-6), clamped to 1.
    """
    if max_norm <= 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm} must be > 0")
    params = list(_params(params_or_model))
    owned = [(p, g) for p in params if (g := p.grad) is not None]
    grads = [g for _, g in owned]
    device = grads[0].device if grads else torch.device("cpu")
    counted = [(p, g) for p, g in owned if hasattr(p, "tp_split_dim") or state.tp.rank == 0]
    experts = [g for p, g in counted if getattr(p, "ep_expert", False)]
    sq = _square_sum([g for p, g in counted if not getattr(p, "ep_expert", False)], device)
    # each ep rank holds other experts: their squares add up over the ep group. Asked whenever this stage holds
    # experts, gradient or not: every rank of the ep group (the same stage) joins, even one whose experts are frozen
    if state.ep.size > 1 and any(getattr(p, "ep_expert", False) for p in params):
        sq = sq + state.ep.all_reduce(_square_sum(experts, device))
    state.tp.all_reduce(sq)
    state.pp.all_reduce(sq)  # each stage holds different layers
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return norm
