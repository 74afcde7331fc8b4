"""apply_tensor_parallel: turn the plain model into its Megatron TP version, in place.

A declarative plan (torchtitan's ``parallelize_module`` idea, written out by hand) maps
module-name patterns of ``dist_trainer.model`` to parallel styles; each style replaces or
decorates the module it matches. Megatron's layout (Shoeybi et al. 2019, section 3):

    tok_emb                vocab-parallel embedding (g, or reduce-scatter under SP)
    layers.*.attn          enter the TP region once: f (or SP all-gather) for q, k and v
    layers.*.attn.q_proj   column-parallel: heads split across ranks
    layers.*.attn.k/v_proj column-parallel when tp divides n_kv_heads, else replicated
    layers.*.attn.o_proj   row-parallel: g (or SP reduce-scatter), bias added once
    layers.*.attn.q_norm   QK-norm (model.qk_norm), and k_norm: per head ("head": one weight every head shares,
                           replicated, each rank's gradient a partial sum over its heads), or over the full width
                           ("full": the weight split with the projection's rows, the sum of squares summed over TP)
    layers.*.attn.q_b_proj latent attention (model.kv_lora_rank, model_mla.py): q_b_proj and kv_b_proj column-parallel
    layers.*.attn.kv_b_proj  by whole heads; q_a_proj, kv_a_proj and their norms replicated, each rank's gradient a
                           partial sum over its heads (summed over TP), as the f before them sums the input's
    layers.*.mlp           enter the TP region once for up and gate
    layers.*.mlp.up/gate   column-parallel
    layers.*.mlp.down_proj row-parallel
    mlm_transform          BERT's MLM transform (dense, norm): replicated, run before the head enters the TP region
    head                   column-parallel, vocabulary split (untied models)
    output_bias            BERT's decoder bias: split along the vocabulary like the head's rows (same padding)
    loss                   vocab-parallel cross-entropy
    layers.*.moe           a mixture-of-experts block is replicated on every TP rank (router and experts whole,
                           as DeepSpeed-MoE without expert slicing); under SP it gathers the sequence first
    An encoder-decoder's decoder layers (dec_layers.*) as the layers above, and between them:
    dec_layers.*.cross_attn          enter the TP region for q over the decoder state and for k/v over the encoder
                                     output (the memory): f, or under SP the all-gather of each
    dec_layers.*.cross_attn.q_proj   column-parallel over the decoder state
    dec_layers.*.cross_attn.k/v_proj column-parallel over the encoder output
    dec_layers.*.cross_attn.o_proj   row-parallel
    rel_emb, dec_rel_emb             T5's relative-position tables (buckets x heads): split by head, as the attention

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) adds: norms and dropout
run on sequence shards (their parameters get partial gradients, summed by
``finalize_tp_grads``), the embedding output is scattered into shards, and the head
input is all-gathered. The model-level flow changes only at the seams the model declares
(identities in one process): ``head_input`` enters the TP region before the head, so
``model.logits`` gives this rank's vocabulary shard (what ``model.loss`` consumes);
``full_logits`` gathers the shards for generation; under SP ``pool_input`` gathers the
sequence before the pooler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from dist_trainer.config import ModelConfig
from dist_trainer.facts.mla_shape import MLA_REPLICATED
from dist_trainer.facts.model_shape import kv_sharded
from dist_trainer.layout_rules import check_tp
from dist_trainer.model import Transformer
from dist_trainer.model_blocks import RMSNorm, set_attrs
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.comms import (
    enter_tp_region,
    gather_from_sequence,
    gather_from_tp,
    gather_sequence_for_replicated,
    scatter_to_sequence,
)
from dist_trainer.parallel.tp.layers import (
    ColumnParallelLinear,
    ReplicatedKVLinear,
    RowParallelLinear,
    SplitRMSNorm,
    VocabParallelEmbedding,
    VocabParallelLoss,
    mark_partial_grad,
    sharded_param,
)


@dataclass
class TPContext:
    """What the styles and the bound model methods need; stored as ``model.tp_context``."""

    cfg: ModelConfig
    group: AxisGroup
    sequence_parallel: bool
    embed_reduce_scatter: bool  # SP and nothing is added to the token embedding: reduce-scatter in tok_emb


# ---- styles: each returns the module that replaces the matched one --------------------


class Style:
    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        raise NotImplementedError


class EnterRegion(Style):
    """``f`` (or the SP all-gather) on the module's first input, once for all its projections."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        def hook(_: nn.Module, args: tuple) -> tuple:
            return (enter_tp_region(args[0], ctx.group, ctx.sequence_parallel), *args[1:])

        module.register_forward_pre_hook(hook)
        return module


class EnterCrossRegion(Style):
    """Cross-attention: ``f`` (or the SP all-gather) on the decoder state for q and on the ``memory`` (the encoder
    output) for k and v. Each decoder layer enters the memory on its own, so each one's k/v gradient is summed over
    TP (or reduce-scattered back to the memory's sequence shards) by its own ``f``."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            memory = enter_tp_region(kwargs["memory"], ctx.group, ctx.sequence_parallel)
            return (enter_tp_region(args[0], ctx.group, ctx.sequence_parallel), *args[1:]), {**kwargs, "memory": memory}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class HeadSplit(Style):
    """A relative-position table (buckets x heads): this rank's heads, the columns [r H/t, (r+1) H/t)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        assert isinstance(module, nn.Embedding), type(module)
        module.weight = sharded_param(module.weight, 1, ctx.group)
        return module


class ScatterInputToSequence(Style):
    """SP: split the (replicated) embedding sum into sequence shards before this module."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        module.register_forward_pre_hook(lambda _, args: (scatter_to_sequence(args[0], ctx.group), *args[1:]))
        return module


class Colwise(Style):
    """Column-parallel inside an already entered region (the parent applied EnterRegion)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        assert isinstance(module, nn.Linear), type(module)
        return ColumnParallelLinear(module, ctx.group, copy_input=False, sequence_parallel=ctx.sequence_parallel)


class KVColwise(Style):
    """k/v: heads split when tp divides n_kv_heads, else replicated with partial gradients."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        cfg = ctx.cfg
        if kv_sharded(cfg, ctx.group.size):  # the planner's counts follow the same rule
            return Colwise().apply(module, ctx)
        assert isinstance(module, nn.Linear), type(module)
        return ReplicatedKVLinear(module, ctx.group, cfg.n_heads, cfg.kv_heads, cfg.head_dim)


class Rowwise(Style):
    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        assert isinstance(module, nn.Linear), type(module)
        return RowParallelLinear(module, ctx.group, input_is_parallel=True, sequence_parallel=ctx.sequence_parallel)


class VocabEmbedding(Style):
    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        assert isinstance(module, nn.Embedding), type(module)
        return VocabParallelEmbedding(module, ctx.group, reduce_scatter_output=ctx.embed_reduce_scatter)


class VocabLoss(Style):
    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        return VocabParallelLoss(ctx.group, ctx.cfg.vocab_size)


class SequenceGathered(Style):
    """SP: a block every TP rank computes in full on whole sequences (MoE routes a sequence as one): all-gather
    the sequence shards before it (this rank's slice of the gradient backward), keep this rank's shard of its
    output (all-gather of the gradient backward). Every rank then holds the same full gradients of the block's
    parameters and router losses, as without SP."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        module.register_forward_pre_hook(
            lambda _, args: (gather_sequence_for_replicated(args[0], ctx.group), *args[1:]))
        module.register_forward_hook(lambda _, args, out: scatter_to_sequence(out, ctx.group))
        return module


class QKNorm(Style):
    """q_norm / k_norm after column-parallel q / k (model.qk_norm): "head" normalises each of this rank's heads with
    the one weight all heads share, so the weight stays whole and its gradient covers this rank's heads only
    (summed over TP by ``finalize_tp_grads``); "full" normalises over all heads' features, so the weight is split
    with the heads and the sum of squares is summed over TP (``SplitRMSNorm``). ``check_tp`` refuses "full" where k/v
    are replicated (a rank would not hold k's whole width in order)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        if ctx.cfg.qk_norm == "full":
            assert isinstance(module, RMSNorm), type(module)  # model.qk_norm needs model.norm=rmsnorm
            return SplitRMSNorm(module, ctx.group)
        for p in module.parameters():
            mark_partial_grad(p, ctx.group)
        return module


class HeadShared(Style):
    """Latent attention's down projections and their norms: whole on every rank, their output read by this rank's
    heads only, so each rank's gradient is a partial sum over heads (summed by ``finalize_tp_grads``)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        for p in module.parameters():
            mark_partial_grad(p, ctx.group)
        return module


class SequenceSharded(Style):
    """SP: the module runs on a sequence shard, so its parameters' gradients are partial."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        for p in module.parameters():
            mark_partial_grad(p, ctx.group)
        return module


def tp_plan(cfg: ModelConfig, sequence_parallel: bool) -> list[tuple[str, Style]]:
    """The table: module-name pattern (``*`` = one name component) -> style. ``layers`` is an encoder-decoder's
    encoder, ``dec_layers`` its decoder (whose ``cross_attn`` reads the encoder output)."""
    plan: list[tuple[str, Style]] = [("tok_emb", VocabEmbedding()), ("rel_emb", HeadSplit()),
                                     ("dec_rel_emb", HeadSplit())]
    for stack in ("layers", "dec_layers"):
        plan += [
            (f"{stack}.*.attn", EnterRegion()),
            (f"{stack}.*.attn.q_proj", Colwise()),
            (f"{stack}.*.attn.k_proj", KVColwise()),
            (f"{stack}.*.attn.v_proj", KVColwise()),
            (f"{stack}.*.attn.o_proj", Rowwise()),
            (f"{stack}.*.attn.q_norm", QKNorm()),
            (f"{stack}.*.attn.k_norm", QKNorm()),
            *[(f"{stack}.*.attn.{leaf}", HeadShared()) for leaf in MLA_REPLICATED],
            (f"{stack}.*.attn.q_b_proj", Colwise()),
            (f"{stack}.*.attn.kv_b_proj", Colwise()),
            (f"{stack}.*.mlp", EnterRegion()),
            (f"{stack}.*.mlp.up_proj", Colwise()),
            (f"{stack}.*.mlp.gate_proj", Colwise()),
            (f"{stack}.*.mlp.down_proj", Rowwise()),
        ]
    plan += [
        ("dec_layers.*.cross_attn", EnterCrossRegion()),
        ("dec_layers.*.cross_attn.q_proj", Colwise()),  # over the decoder state
        ("dec_layers.*.cross_attn.k_proj", KVColwise()),  # over the encoder output
        ("dec_layers.*.cross_attn.v_proj", KVColwise()),
        ("dec_layers.*.cross_attn.o_proj", Rowwise()),
        ("dec_layers.*.cross_attn.q_norm", QKNorm()),
        ("dec_layers.*.cross_attn.k_norm", QKNorm()),
        ("head", Colwise()),  # entered by the bound logits(), after the final norm
        ("loss.inner" if cfg.loss_chunk_tokens else "loss", VocabLoss()),  # model_loss.ChunkedLoss wraps it
    ]
    if sequence_parallel:
        # every norm between the TP regions, wherever it is placed (before a branch, after it: post_branch and
        # sandwich's attn_post_norm / mlp_post_norm, both branches' under parallel_residual)
        plan += [(name, SequenceSharded()) for name in (
            "layers.*.attn_norm", "layers.*.mlp_norm", "layers.*.attn_post_norm", "layers.*.mlp_post_norm",
            "final_norm", "mlm_transform", "enc_norm",
            "dec_layers.*.attn_norm", "dec_layers.*.cross_norm", "dec_layers.*.mlp_norm")]
        plan.append(("layers.*.moe", SequenceGathered()))
        if not _embed_reduce_scatter(cfg, sequence_parallel):
            # Positions / token types are added to the full sequence, then the sum is split
            # (Megatron-core's LanguageModelEmbedding does the same when it adds positions).
            post = cfg.norm_placement == "post" and not cfg.encoder_decoder  # an encoder-decoder has no emb_norm
            plan.append(("emb_norm" if post else "emb_drop", ScatterInputToSequence()))
        if cfg.norm_placement == "post":
            plan.append(("emb_norm", SequenceSharded()))
    return plan


def _embed_reduce_scatter(cfg: ModelConfig, sequence_parallel: bool) -> bool:
    return sequence_parallel and cfg.pos_embedding == "rope" and not cfg.n_token_types


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def apply_tensor_parallel(model: Transformer, state: ParallelState, sequence_parallel: bool = False) -> Transformer:
    """Shard ``model`` (plain, fully initialised) over ``state.tp`` in place; return it.

    A no-op for tp_size 1. Parameter names stay those of the plain model, so
    ``reshard`` and the optimizer see the same keys in every layout.
    """
    group = state.tp
    cfg = model.cfg
    check_tp(cfg, group.size)
    if group.size == 1:
        return model
    if hasattr(model, "tp_context"):
        raise RuntimeError("apply_tensor_parallel: this model is already tensor-parallel")
    ctx = TPContext(cfg, group, sequence_parallel, _embed_reduce_scatter(cfg, sequence_parallel))
    plan = tp_plan(cfg, sequence_parallel)
    for name, module in list(model.named_modules()):
        for pattern, style in plan:
            if _matches(pattern, name):
                new = style.apply(module, ctx)
                if new is not module:
                    parent, _, child = name.rpartition(".")
                    setattr(model.get_submodule(parent), child, new)
                    module = new
    if model.output_bias is not None:  # a parameter of the model itself, which no module pattern reaches
        model.output_bias = sharded_param(model.output_bias, 0, group)
    # the model's declared seams (model.py): this rank's vocabulary shard of the logits, gathered for generation
    model.head_input = EnterRegionModule(group, sequence_parallel)
    model.full_logits = GatherVocabulary(group, cfg.vocab_size)
    if sequence_parallel:
        model.pool_input = GatherSequence(group)
    set_attrs(model, tp_context=ctx)
    return model


class EnterRegionModule(nn.Module):
    """``f`` (identity forward, all-reduce backward), or SP's all-gather: the head's replicated input (after the
    final norm and the MLM transform, which each rank computes in full, their gradient summed whole by ``f``'s
    backward; under SP on the sequence shard, their partial gradients summed by ``finalize_tp_grads``) meets this
    rank's vocabulary rows of the head, or of the shared embedding when tied, and of the output bias."""

    def __init__(self, group: AxisGroup, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return enter_tp_region(x, self.group, self.sequence_parallel)


class GatherVocabulary(nn.Module):
    """(B, T, V_padded/t) this rank's logits -> (B, T, V) the full logits (generation; the loss keeps its shard)."""

    def __init__(self, group: AxisGroup, vocab_size: int) -> None:
        super().__init__()
        self.group, self.vocab_size = group, vocab_size

    def forward(self, local: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(local, self.group)[..., : self.vocab_size]


class GatherSequence(nn.Module):
    """SP: the last hidden state is a sequence shard; the pooler reads token 0 of the whole sequence."""

    def __init__(self, group: AxisGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence(hidden, self.group)


def tp_context(model: nn.Module) -> TPContext:
    """The TPContext ``apply_tensor_parallel`` stored on ``model``."""
    ctx = getattr(model, "tp_context", None)
    assert isinstance(ctx, TPContext), "the model is not tensor-parallel (apply_tensor_parallel was not applied)"
    return ctx
