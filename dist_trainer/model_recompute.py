"""Op-level selective recomputation: torchtitan's policy through ``torch.utils.checkpoint``'s selective policy.

``parallel.activation_checkpointing=op`` runs every layer under non-reentrant ``torch.utils.checkpoint`` with a
policy deciding op by op (torchtitan, ``torchtitan/distributed/activation_checkpoint.py``, ``_apply_op_sac``): the
outputs of the attention kernel and of every other matmul (the 1st, 3rd, 5th, ... of the layer's forward) are
kept, everything else (norms, RoPE, activations, casts, the other matmuls, collectives) runs again in backward.
The layer keeps its input (the checkpoint's argument) and those outputs; on Llama's layer the kept matmuls are
q_proj, v_proj, up_proj and down_proj, the recomputed ones k_proj, o_proj and gate_proj.

Ours beside torchtitan's list: ``addmm`` counts as a matmul (a linear with a bias dispatches to it, torchtitan's
models have none), and PyTorch's CPU flash kernel is kept as CUDA's flash and memory-efficient kernels are. The
explicit attention (the math kernel, Gemma 2's soft-capped scores) dispatches to ``bmm``: recomputed, as in
torchtitan. The dropless experts' ``torch._grouped_mm`` counts as a matmul too: each of the three is one
projection of every routed row (N x top_k of them whatever the routing), as a dense MLP's mm is of every token.
The planner's price is ``planner/op_recompute.py``; tests/test_planner_activations.py measures it.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    create_selective_checkpoint_contexts,
)

aten = torch.ops.aten
# counted: every other one is kept; the dropless experts' grouped matmul (model_moe_experts.py) is one matmul of
# every expert's rows, as one linear's mm is (it runs inside a custom autograd Function, whose ops the policy sees)
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten._grouped_mm.default})
ATTENTION_KERNELS = frozenset({  # kept: their outputs (with the log-sum-exp) are what their backward reads
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
})


def _policy(counts: dict[str, int], ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torchtitan's ``_custom_policy``: the forward and its recompute count matmuls apart, so both keep the same
    ones (the 1st, 3rd, ...)."""
    if func in MATMULS:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in ATTENTION_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


class _Recompute(_CachedTorchDispatchMode):
    """The selective checkpoint's recompute mode, asked only about the ops the policy may keep; every other op runs.

    torch's own mode replays the forward op by op and refuses an op the forward did not run as often. A layer's
    recompute need not: DeepSpeed ZeRO-3 gathers a module's parameters in hooks, prefetched outside the layer in
    forward and gathered inside it in backward (collectives and copies the forward's count never saw). Only the
    kept ops' order matters (the matmuls and attention kernels, which no regime adds or drops)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in MATMULS or func in ATTENTION_KERNELS:
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


def op_recompute_contexts() -> tuple[Any, Any]:
    """``context_fn`` of one layer's checkpoint: a fresh count per call (one layer's forward and recompute)."""
    forward, _ = create_selective_checkpoint_contexts(partial(_policy, defaultdict(int)))
    return forward, _Recompute(forward.policy_fn, forward.storage)
