"""``train.compile``: each transformer block and the loss head through ``torch.compile`` (inductor).

torchtitan's recipe (``apply_compile`` in its parallelize step): compile per block rather than the whole model, so
one compiled graph serves every layer of the same shape (Dynamo guards a block on its structure, not on its
identity), compile time does not grow with depth, and whatever wraps the blocks (DDP, the pipeline schedule,
DeepSpeed's ZeRO-1/2 engine, activation checkpointing) stays eager and unchanged. Each module is
compiled in place with ``nn.Module.compile`` (its ``__call__`` runs the compiled call; its ``forward``, its
names and its parameters are untouched), so checkpoints, the TP plan and the optimizer groups see the same
model. The head's matmul is left eager (one GEMM: nothing to fuse); the final norm, BERT's MLM transform and
the loss (the fp32 cast, log-softmax and gather of cross-entropy, or the vocab-parallel one's local maths) are
compiled.

Collectives stay eager: ``AxisGroup``'s collectives are ``torch.compiler.disable``d (``parallel/comm.py``), since
their counting, numbering and timing is Python state a traced graph would run once, at trace time. Under TP, SP
and EP a compiled block is therefore a few graphs with the counted collectives between them (a graph break at
each), the same collectives in the same order as eager.

Two layouts are refused before launch (``layout_rules.COMPILE_REFUSED`` says why): ZeRO-3, whose per-module
gather hooks split every block at each sub-module, and the zero-bubble schedule, whose split of each backward into
an input pass and a weight pass a compiled block (one autograd node) cannot take. Measured speed-ups and compile
times: docs/performance.md.

The compile cache (``TORCHINDUCTOR_CACHE_DIR``; the Makefile and the tests keep it in ``.torchinductor/``) makes
every later run of the same shapes start in seconds. A run that exceeds Dynamo's recompile limit fails rather
than falling back to eager unannounced (``fail_on_recompile_limit_hit``): a compiled run is compiled.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn

from dist_trainer.parallel.loss import TokenWeightedLoss

# The model's modules compiled besides its blocks: the last stage's final norm, BERT's MLM transform and the loss.
HEAD_MODULES = ("final_norm", "mlm_transform", "loss")


def compile_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs ``apply_compile`` compiles in ``model`` (a ``Transformer``, a TP one or a pipeline
    stage's trimmed one): every layer block, then the head modules the model holds."""
    targets = [(f"layers.{name}", block) for name, block in model.get_submodule("layers").named_children()]
    for name in HEAD_MODULES:
        module = getattr(model, name, None)
        if isinstance(module, TokenWeightedLoss):  # its step's token count changes every step: eager, its loss not
            module = module.inner
        if isinstance(module, nn.Module):
            targets.append((name, module))
    return targets


def apply_compile(model: nn.Module, backend: str = "inductor") -> list[str]:
    """Compile each block and head module of ``model`` in place (``nn.Module.compile``); the names compiled.

    Call it on this rank's model once its regime has rewritten it (TP layers, EP experts, a pipeline stage's
    pieces, the recompute modes) and before the wrapper (DDP, the schedule, DeepSpeed) takes it.
    """
    # Dynamo keeps one cache per code object; every compiled module shares nn.Module._call_impl's, so the
    # variants (each block kind, train and eval, the head modules) count against one limit: raise it to what a
    # model can need, and fail loudly past it instead of silently running eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    targets = compile_targets(model)
    for _, module in targets:
        module.compile(backend=backend)
    return [name for name, _ in targets]


def is_compiled(module: nn.Module) -> bool:
    """Whether ``apply_compile`` compiled ``module`` (its calls run the compiled call)."""
    return getattr(module, "_compiled_call_impl", None) is not None
