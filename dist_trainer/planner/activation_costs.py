"""Per-stage activation bytes: each layer's cost in every recomputation mode, assembled over a rank's layers.

``activations.py`` lists what each piece of the model saves for backward; this module prices one rank of a layout
with it: the layers it holds (each with its own cost when fine-tuning freezes parts of the model, as on the first
pipeline stage or a later one), the embedding on the first stage, the head and the loss's backward on the last,
autocast's weight copies, and the micro-batches in flight (``activations.in_flight_microbatches``). A
mixture-of-experts layer (``cfg.is_moe_layer``) has a cost of its own: its ``moe`` block in place of the MLP; so does
a sliding-window layer (``cfg.is_sliding_layer``: its mask).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial

from dist_trainer.config import ModelConfig
from dist_trainer.planner import documents
from dist_trainer.planner.activation_spec import RECOMPUTE, ActivationSpec, per_token, recomputed_layers
from dist_trainer.planner.activations import (
    amp_weight_copies,
    attention_core_saved_tensors,
    checkpointed_layer_saved_tensors,
    layer_flow,
    layer_saved_tensors,
)
from dist_trainer.planner.activations_ends import embedding_saved_tensors, head_saved_tensors
from dist_trainer.planner.finetune import ALL_TRAIN, GradPlan, LayerGrads, head_trains
from dist_trainer.planner.loss_costs import PIPELINE_LOGITS, amp_head_copy, loss_working_set, pipeline_logits
from dist_trainer.planner.op_recompute import op_saved_tensors

OFFLOADED = "offloaded_to_host"  # stage_activations' term of host memory, apart from the device's


@dataclass(frozen=True)
class LayerCost:
    """One layer's bytes per token of one micro-batch in each recomputation mode, and its autocast weight copies."""

    full: float  # not recomputed
    selective: float  # its attention core recomputed (keeps the projections' outputs instead)
    checkpointed: float  # fully recomputed: its input only (kept even in a frozen layer)
    op: float  # op-level recomputation: its input, its attention kernel's and every other matmul's outputs
    attention_core: float  # what its recomputed attention core holds while its backward runs
    amp_weights: int  # 16-bit weight copies autocast keeps per micro-batch (0 unless amp_*)


def _layer_cost(cfg: ModelConfig, spec: ActivationSpec, g: LayerGrads, moe: bool = False,
                sliding: bool = False) -> LayerCost:
    flow = layer_flow(cfg, g)
    rope = documents.document_layer_tensors(cfg, spec, rotated=flow["core_q"] or flow["core_k"])
    return LayerCost(full=per_token(layer_saved_tensors(cfg, spec, grads=g, moe=moe, sliding=sliding) + rope),
                     selective=per_token(layer_saved_tensors(cfg, spec, selective=True, grads=g, moe=moe,
                                                             sliding=sliding)),
                     checkpointed=per_token(checkpointed_layer_saved_tensors(cfg, spec)),
                     op=per_token(op_saved_tensors(cfg, spec, grads=g, moe=moe)),
                     attention_core=per_token(attention_core_saved_tensors(
                         cfg, spec, flow["core_q"], flow["core_k"], flow["core_v"], sliding)),
                     amp_weights=amp_weight_copies(cfg, spec, g, moe))


@dataclass(frozen=True)
class LayerCosts:
    """Bytes per token of one micro-batch, and the per-forward autocast weight copies, for one rank.

    Every layer costs ``layer`` unless fine-tuning freezes parts of the model: then each layer has its own cost,
    as it sits on the first pipeline stage (its input's gradient as in one process) or on a later one (received
    activations always require grad), and the head costs ``head_staged`` on a last stage that is not the first.
    The MoE layers (``moe_ids``) cost ``moe_layer``; a model with sliding-window layers (``sliding_ids``) has a
    cost per kind, (MoE, sliding), in ``kinds``.
    """

    layer: LayerCost
    embedding: float
    head: float
    loss_backward: Callable[[int], float]  # tokens -> the loss's working set in backward (loss_costs.py)
    amp_head_weights: int
    per_layer: tuple[LayerCost, ...] = ()
    per_layer_staged: tuple[LayerCost, ...] = ()
    head_staged: float | None = None
    moe_layer: LayerCost | None = None
    moe_ids: frozenset[int] = frozenset()
    sliding_ids: frozenset[int] = frozenset()
    kinds: dict[tuple[bool, bool], LayerCost] | None = None
    selective_inputs: float = 0.0  # per stage under selective recomputation: the segment ids every core reads
    # a pipeline's last stage: the logits it outputs (the whole loss's input), which torch.distributed.pipelining
    # keeps until that micro-batch's backward (loss_costs.pipeline_logits)
    pipeline_logits: float = 0.0

    @property
    def full(self) -> float:
        return self.layer.full

    def of(self, i: int, staged: bool) -> LayerCost:
        if not self.per_layer:
            if self.kinds is not None:
                return self.kinds[(i in self.moe_ids, i in self.sliding_ids)]
            return self.moe_layer if self.moe_layer is not None and i in self.moe_ids else self.layer
        return (self.per_layer_staged if staged else self.per_layer)[i]


def layer_costs(cfg: ModelConfig, spec: ActivationSpec, plan: GradPlan | None = None) -> LayerCosts:
    """Per-token costs of this model's layers, embedding and head on one rank; ``plan``: a fine-tuning run's
    gradients (``planner/finetune.grad_plan``; None when everything trains)."""
    amp_head = amp_dense = 0
    if spec.precision.startswith("amp"):
        # the head's cast weight; a chunked loss casts it inside each chunk's checkpoint (kept by none)
        amp_head = 0 if cfg.loss_chunk_tokens else amp_head_copy(cfg, spec)
        amp_dense = 2 * cfg.d_model * cfg.d_model if cfg.mlm_head else 0  # the MLM transform's dense, whole
    moe_ids = frozenset(i for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    sliding_ids = frozenset(i for i in range(cfg.n_layers) if cfg.is_sliding_layer(i))
    kinds = {(i in moe_ids, i in sliding_ids) for i in range(cfg.n_layers)}
    by_kind = {kind: _layer_cost(cfg, spec, ALL_TRAIN, *kind) for kind in sorted(kinds)}
    layer = by_kind.get((False, False)) or _layer_cost(cfg, spec, ALL_TRAIN)  # a dense, global layer
    # asked once per stage and mode of every layout the search measures, of a few micro-batch sizes
    loss_backward = lru_cache(maxsize=None)(partial(loss_working_set, cfg, spec, head_trains=head_trains(plan)))
    kept_logits = pipeline_logits(cfg, spec)
    moe_layer = _layer_cost(cfg, spec, ALL_TRAIN, moe=True) if moe_ids else None
    selective_inputs = per_token(documents.document_stage_tensors(spec, selective=True))
    if plan is None:
        return LayerCosts(layer, embedding=per_token(embedding_saved_tensors(cfg, spec)
                                                     + documents.document_embedding_tensors(cfg, spec)),
                          head=per_token(head_saved_tensors(cfg, spec)), loss_backward=loss_backward,
                          amp_head_weights=amp_head + amp_dense, moe_layer=moe_layer, moe_ids=moe_ids,
                          sliding_ids=sliding_ids, kinds=by_kind, selective_inputs=selective_inputs,
                          pipeline_logits=kept_logits)
    cache: dict[tuple[LayerGrads, bool, bool], LayerCost] = {}

    def cost(i: int, g: LayerGrads) -> LayerCost:
        key = (g, i in moe_ids, i in sliding_ids)
        if key not in cache:
            cache[key] = _layer_cost(cfg, spec, g, i in moe_ids, i in sliding_ids)
        return cache[key]

    # a linear keeps autocast's copy of its weight when its input requires grad: the dense's is the head input's
    # (the last layer's output), the head's is the transform's output when a transform module trains
    head = "head" in plan.tail or bool(plan.tail & {"mlm_transform.dense", "mlm_transform.norm"})
    return LayerCosts(
        layer, loss_backward=loss_backward,
        embedding=per_token(embedding_saved_tensors(cfg, spec, plan.embedding)
                            + documents.document_embedding_tensors(cfg, spec, plan.embedding)),
        head=per_token(head_saved_tensors(cfg, spec, plan.head_input(False), plan.tail)),
        head_staged=per_token(head_saved_tensors(cfg, spec, True, plan.tail)),
        amp_head_weights=(amp_head if head or plan.head_input(False) else 0)
        + (amp_dense if plan.head_input(False) else 0),
        per_layer=tuple(cost(i, plan.layer(i, False)) for i in range(cfg.n_layers)),
        per_layer_staged=tuple(cost(i, plan.layer(i, True)) for i in range(cfg.n_layers)),
        moe_layer=moe_layer, moe_ids=moe_ids, sliding_ids=sliding_ids, kinds=by_kind,
        selective_inputs=selective_inputs, pipeline_logits=kept_logits)


def stage_activations(costs: LayerCosts, *, mode: str, every: int, layer_ids: Sequence[int], tokens: int,
                      first: bool, last: bool, in_flight: float, offload: float = 0.0) -> dict[str, int]:
    """Activation terms of one pipeline stage at its peak, in bytes.

    ``saved``: what the autograd graph holds for ``in_flight`` micro-batches (the saved-tensor-hook figure);
    ``amp_weight_copies``: autocast's 16-bit weight casts held by the graph (not made inside recomputed layers, nor
    under op-level recomputation, which recomputes them);
    ``backward_working_set``: the larger of two transients of one micro-batch's backward that never coexist:
    the loss's gradients on the last stage (``loss_costs.loss_working_set``: its backward ends before the
    first layer's starts) and one recomputed layer's full saved tensors (selective: its attention core; op: the
    whole layer's, beside what the policy kept), alive
    while that layer's backward runs. The first stage's layers are the leading run 0, 1, 2, ... of ``layer_ids``
    on the rank that holds the embeddings; every other layer sits on a later stage.

    ``offload``: the share of the rank's layers (the first ceil(share x n), ``Transformer.set_activation_offload``)
    whose saved tensors go to host memory (``model_offload.py``): what the hooks see of them (their saved tensors and
    autocast's weight casts; a recomputed layer its input, also under op-level recomputation, whose kept outputs
    stay) leaves ``saved`` and ``amp_weight_copies`` for ``offloaded_to_host`` (host memory, not the device's);
    one layer of prefetch brings one layer's back before its backward, within the backward working set's bound.
    """
    if mode not in RECOMPUTE:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(RECOMPUTE)}")
    per_token = weights = recompute = host = 0.0
    has_layers = bool(layer_ids)
    n_off = math.ceil(offload * len(layer_ids) - 1e-9)  # the first n_off of layer_ids
    if not (costs.per_layer or costs.moe_ids or costs.sliding_ids):  # every layer costs .layer: counted at once
        c = costs.layer
        if mode == "op":  # the loop's op case: c.op - c.checkpointed stays, the hooks see c.checkpointed
            per_token = len(layer_ids) * (c.op - c.checkpointed) + (len(layer_ids) - n_off) * c.checkpointed
            host, recompute = n_off * c.checkpointed * tokens, c.full if layer_ids else 0.0
        else:  # (recomputed, kept) layers, on the device and offloaded
            kept = c.selective if mode == "selective" else c.full
            n_redone = len(recomputed_layers(mode, every, layer_ids))
            r_off = len(recomputed_layers(mode, every, layer_ids[:n_off])) if n_off else 0
            r_on, k_off = n_redone - r_off, n_off - r_off
            k_on = len(layer_ids) - n_off - r_on
            per_token, weights = r_on * c.checkpointed + k_on * kept, k_on * c.amp_weights
            host = (r_off * c.checkpointed + k_off * kept) * tokens + k_off * c.amp_weights
            recompute = max(c.full if n_redone else 0.0,
                            c.attention_core if mode == "selective" and len(layer_ids) > n_redone else 0.0)
        layer_ids = ()
    if layer_ids:  # each with its own cost (fine-tuning, MoE or sliding-window layers)
        chained = 0
        while first and chained < len(layer_ids) and layer_ids[chained] == chained:
            chained += 1
        redone = set(recomputed_layers(mode, every, layer_ids))
        offloaded = set(layer_ids[:n_off])
        for k, i in enumerate(layer_ids):
            c = costs.of(i, staged=k >= chained)
            if mode == "op":  # the hooks see its input; the policy's cache holds the rest, which stays
                stays, moves, cast = c.op - c.checkpointed, c.checkpointed, 0
                recompute = max(recompute, c.full)
            elif i in redone:
                stays, moves, cast = 0.0, c.checkpointed, 0
                recompute = max(recompute, c.full)
            else:
                stays, moves, cast = 0.0, (c.selective if mode == "selective" else c.full), c.amp_weights
                recompute = max(recompute, c.attention_core if mode == "selective" else 0.0)
            per_token += stays
            if i in offloaded:  # the hooks move what they see of the layer, autocast's weight casts too
                host += moves * tokens + cast
            else:
                per_token += moves
                weights += cast
    if mode == "selective" and has_layers:
        per_token += costs.selective_inputs
    head = costs.head_staged if costs.head_staged is not None and not first else costs.head
    per_token += (costs.embedding if first else 0.0) + (head if last else 0.0)
    weights += costs.amp_head_weights if last else 0
    terms = {
        "saved": round(per_token * tokens * in_flight),
        "amp_weight_copies": round(weights * in_flight),
        "backward_working_set": round(max(recompute * tokens, costs.loss_backward(tokens) if last else 0.0)),
    }
    if last and not first and costs.pipeline_logits:  # a pipeline's last stage (with one stage: none kept)
        terms[PIPELINE_LOGITS] = round(costs.pipeline_logits * tokens * in_flight)
    return terms | ({OFFLOADED: round(host * in_flight)} if n_off else {})
