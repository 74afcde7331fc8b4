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
The planner's price is ``planner/op_recompute.py``; tests/test_planner_activations.py measures it. The kept outputs
live in the policy's cache, where no saved-tensor hook sees them: each layer's cache counts the distinct storages it
holds into the model's ``LiveBytes`` (``Transformer.kept``) until backward consumes them or the cache goes, so a
run's plan check measures them.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from functools import partial
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
)

from dist_trainer.model_offload import LiveBytes

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


class _Account:
    """The bytes of the distinct storages one layer's cache holds, in ``counter``."""

    def __init__(self, counter: LiveBytes) -> None:
        self.counter, self.held = counter, [0]
        self.refs: dict[int, int] = {}  # storage -> the cached outputs on it
        self.sizes: dict[int, int] = {}

    def change(self, entry: Any, sign: int) -> None:
        """``entry`` (a call's version-wrapped outputs) comes into the cache (+1) or leaves it (-1)."""
        for leaf in tree_leaves(entry):
            t = getattr(leaf, "val", None)
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            self.refs[key] = self.refs.get(key, 0) + sign
            if sign > 0 and self.refs[key] == 1:
                self.sizes[key] = storage.nbytes()
                self.held[0] += self.sizes[key]
                self.counter.add(self.sizes[key])
            elif sign < 0 and self.refs[key] == 0:
                del self.refs[key]
                n = self.sizes.pop(key)
                self.held[0] -= n
                self.counter.add(-n)


class _Calls(dict[int, Any]):
    """One op's calls in a layer's cache (call index -> its outputs, or torch's markers), counted as they change."""

    def __init__(self, account: _Account) -> None:
        super().__init__()
        self.account = account

    def __setitem__(self, idx: int, entry: Any) -> None:
        if idx in self:
            self.account.change(self[idx], -1)  # consumed by the recompute
        self.account.change(entry, +1)
        super().__setitem__(idx, entry)


class _Cache(defaultdict[Any, _Calls]):
    """A layer's selective-checkpoint cache (op -> its calls); what it still holds is released when it goes."""

    def __init__(self, counter: LiveBytes) -> None:
        account = _Account(counter)
        super().__init__(partial(_Calls, account))
        weakref.finalize(self, counter.release, account.held)


def op_recompute_contexts(counter: LiveBytes) -> tuple[Any, Any]:
    """``context_fn`` of one layer's checkpoint: a fresh count per call (one layer's forward and recompute), its
    cache's bytes counted in ``counter`` (``torch.utils.checkpoint.create_selective_checkpoint_contexts``' pair over
    a counting cache)."""
    policy = partial(_policy, defaultdict(int))
    storage = _Cache(counter)
    return _CachingTorchDispatchMode(policy, storage), _Recompute(policy, storage)
