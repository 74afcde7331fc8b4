"""parallelize: the plain model cut to this rank, in one written order (torchtitan's ``parallelize_llama``).

Every engine builds the single-process model (or, for pipeline stages, this rank's stages of it) and hands it
here; what each parallelism does to it happens in this order, in one place:

    1. tensor parallelism (+ SP)   ``parallel/tp``: Megatron's column/row/vocab-parallel modules swapped in
    2. expert parallelism           ``parallel/ep``: this rank's experts kept, the token exchange swapped in
       int8 base weights            ``parallel/int8.py``: frozen linears swapped for their int8 classes
                                    (model.base_weight_dtype), each rank quantising its own TP shard
    3. context parallelism          ``parallel/cp``: this rank's part of each sequence, ring or all-to-all attention
       the loss by tokens           ``parallel/loss.py``: the mean over the covered tokens of a split sequence, or
                                    of a step's global batch (chat data), whatever each rank holds
    4. activation recomputation     the layout's mode on the model's own switch (global layer indices)
       compilation                  ``train.compile``: each layer block and the loss head compiled in place
                                    (``parallel/compile.py``; the collectives inside stay eager and counted)
    5. placement                    onto the device; a model built on the meta device (every weight to come from
                                    ``train.init_from``) gets storage for this rank's slices only

The engines then load start weights, wrap (DDP, the pipeline schedule, DeepSpeed) and build the update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dist_trainer.layout_rules import Layout
from dist_trainer.model import Transformer
from dist_trainer.parallel.compile import apply_compile
from dist_trainer.parallel.cp.apply import apply_context_parallel
from dist_trainer.parallel.ep.apply import apply_expert_parallel
from dist_trainer.parallel.int8 import apply_int8, materialize_int8_
from dist_trainer.parallel.loss import TokenWeightedLoss
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.apply import apply_tensor_parallel


def parallelize(model: Transformer, layout: Layout, state: ParallelState, device: torch.device | str,
                first_layer: int = 0, freeze: Sequence[str] = (), compile_blocks: bool = False) -> Transformer:
    """Apply ``layout`` to ``model`` (a whole plain model, or one pipeline stage's whose layers start at global
    index ``first_layer``; ``freeze``: the run's train.freeze, which decides the int8 base weights) in the order
    above; return it, on ``device``."""
    apply_tensor_parallel(model, state, layout.sequence_parallel)
    apply_expert_parallel(model, state)
    apply_int8(model, model.cfg, freeze, first_layer)  # a no-op unless model.base_weight_dtype=int8
    apply_context_parallel(model, state, layout.cp_mode)
    model.loss = TokenWeightedLoss(model.loss, model.sequence, getattr(model.sequence, "group", None))
    model.set_activation_checkpointing(layout.activation_checkpointing, layout.checkpoint_every, first_layer)
    model.set_activation_offload(layout.activation_offload, first_layer)
    if compile_blocks:
        apply_compile(model)
    if any(p.is_meta for p in model.parameters()):
        materialize_(model, device)
    return model.to(device)


def materialize_(model: nn.Module, device: str | torch.device = "cpu") -> None:
    """Give every meta parameter of ``model`` (built on the meta device and already cut to this rank) real,
    uninitialised storage, keeping each Parameter's attributes (the TP tags) and sharing; the position tables are
    computed again. What a rank does instead of drawing the whole model when every weight comes from a source."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                made[id(p)] = new
            module._parameters[name] = made[id(p)]
    init_buffers = getattr(model, "_init_buffers", None)
    if init_buffers is not None:
        init_buffers()
    materialize_int8_(model, device)  # int8 base weights: filled by the start weights, quantised as they stream
    for module in model.modules():  # saved buffers (a MoE layer's expert bias): their initial zeros, then the source's
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta and name not in module._non_persistent_buffers_set:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    assert not meta, f"buffers left on the meta device: {meta[:5]}"
