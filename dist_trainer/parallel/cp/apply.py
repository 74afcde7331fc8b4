"""apply_context_parallel: the model's sequence seams filled for this cp rank (issue 23).

    model.sequence, layers.*.attn.sequence   this rank's tokens and their global positions (split.py)
    layers.*.attn.attend                      ring attention (ring.py) or all-to-all attention (ulysses.py)
    layers.*.moe                              a MoE layer routes whole sequences: it gathers the cp ranks'
                                              tokens in order, computes them all, keeps its own

Applied after tensor parallelism (the loss it wraps may be TP's vocab-parallel one, and a MoE block's SP gather
comes first), before recomputation. A no-op at cp_size 1.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from dist_trainer.model import Transformer
from dist_trainer.model_blocks import Attention, SDPAttention
from dist_trainer.model_mla import MLAttention
from dist_trainer.model_moe import moe_layers
from dist_trainer.parallel.cp.ring import RingLayout, Scores, ring_attention
from dist_trainer.parallel.cp.split import ContextParallelSequence, gather_sequence, keep_local
from dist_trainer.parallel.cp.ulysses import UlyssesAttention
from dist_trainer.parallel.state import ParallelState


class RingAttention(nn.Module):
    """The model's ``attend`` seam under ring context parallelism: the options of the core it replaces (score
    scale, causality, sliding window, soft-cap) applied blockwise."""

    def __init__(self, sequence: ContextParallelSequence, core: SDPAttention, head_dim: int) -> None:
        super().__init__()
        self.sequence = sequence
        self.ring = RingLayout(sequence.group.size, sequence.zigzag)
        scale = 1.0 / math.sqrt(head_dim) if core.scale is None else core.scale
        self.scores = Scores(scale, core.causal, getattr(core, "window", 0), getattr(core, "softcap", 0.0))

    def forward(self, q, k, v, mask=None, documents=None):  # noqa: ANN001, ANN201 - tensors, as SDPAttention.forward
        _no_mask(mask)
        return ring_attention(q, k, v, self.sequence.group, self.ring, self.scores, documents)


def _no_mask(mask: torch.Tensor | None) -> None:
    if mask is not None:  # layout_rules.check_cp refuses the models that attend with a mask tensor
        raise ValueError("context parallelism attends without an attention mask (no position bias or padding)")


def apply_context_parallel(model: Transformer, state: ParallelState, mode: str) -> Transformer:
    """Fill ``model``'s sequence seams for this rank of the cp axis (ring or all_to_all ``mode``); return it."""
    group = state.axes["cp"]
    if group.size == 1:
        return model
    causal = model.cfg.causal
    sequence = ContextParallelSequence(group, zigzag=causal and mode == "ring")
    model.sequence = sequence
    for module in model.modules():
        if isinstance(module, Attention | MLAttention):  # latent attention: its per-head k and v travel the ring
            module.sequence = sequence
            assert isinstance(module.attend, SDPAttention), "context parallelism replaces the plain attention core"
            module.attend = RingAttention(sequence, module.attend, module.head_dim) if mode == "ring" \
                else UlyssesAttention(module.attend, group)
    for layer in moe_layers(model):  # after TP's SP hooks: gather tp, then cp; keep cp's part, then tp's
        layer.register_forward_pre_hook(lambda _, args, seq=sequence: (gather_sequence(args[0], seq), *args[1:]))
        layer.register_forward_hook(partial(_keep_local, sequence), prepend=True)
    return model


def _keep_local(sequence: ContextParallelSequence, _: nn.Module, args: tuple, out):  # noqa: ANN001, ANN202
    return keep_local(out, sequence)
