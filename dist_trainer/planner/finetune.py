"""Fine-tuning in the planner's terms: trainable parameters per module and rank, and the gradients backward computes.

A frozen parameter costs its weights only: no gradient, no optimizer state (nor a ZeRO partition of them, nor a
DDP bucket). Its activations are subtler, because autograd saves a tensor only for a gradient that will be
computed (PyTorch's derivative formulas save ``x`` of ``x @ W`` only when ``W`` requires grad):

- a frozen layer whose input needs no gradient (everything below it is frozen) keeps nothing for backward;
- a frozen layer with something trainable below still passes the gradient down: it keeps what the input
  gradient needs (norm statistics, the attention's tensors, the activation function's input), not the linears'
  inputs, which only weight gradients read;
- a LoRA layer keeps the adapters' inputs and their r-wide products A x.

So each layer is described by ``LayerGrads`` (does its input need a gradient; which weights and adapters train),
the chain of them from the embeddings upward (``grad_plan``), and ``activations.layer_saved_tensors`` keeps a
tensor when a gradient that reads it is computed. A pipeline stage other than the first receives activations
that always require grad (torch.distributed.pipelining marks them so), so its layers pass gradients down
whatever is frozen below. Which modules train is ``dist_trainer.facts.finetune``'s answer, as in the trainer.

A mixture-of-experts layer's ``moe`` block (router, experts by global index, shared expert) stands where the MLP
is: its parameters count in full (every expert, not the top_k a token meets: each holds gradients and states),
the experts of one expert-parallel rank only under ``ep_size`` > 1, never divided by TP (the block is whole on
every TP rank). For the activations the block is one unit: its tensors are kept when any of its modules trains or
its input needs a gradient (``LayerGrads`` marks the MLP leaves trained then), an upper bound when part of the
block is frozen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from dist_trainer.config import ModelConfig
from dist_trainer.facts.finetune import layer_module_name, module_training, moe_module_names, trainable_expert_params
from dist_trainer.facts.model_names import (
    DECODER_LAYER_MODULES,
    FIRST_STAGE_MODULES,
    LAYER_MODULES,
    MLP_LEAVES,
    TAIL_NAMES,
)
from dist_trainer.facts.model_shape import (
    decoder_first_params,
    decoder_layer_params,
    embedding_params,
    encoder_last_params,
    layer_params,
    moe_block_params,
    tail_params,
)
from dist_trainer.planner.params import lora_layer_params


@dataclass(frozen=True)
class LayerGrads:
    """Which gradients one layer's backward computes: all of them unless fine-tuning freezes some.

    ``input``: the layer's input requires grad; ``base``: the leaves (model_names.LAYER_MODULES) whose own
    parameters train; ``adapters``: the leaves whose LoRA adapter (rank ``rank``) trains; ``dropout``: the
    adapters drop their input (model.lora_dropout > 0), so they keep their own dropped copy and its mask.
    """

    input: bool = True
    base: frozenset[str] = frozenset(LAYER_MODULES)
    adapters: frozenset[str] = frozenset()
    rank: int = 0
    dropout: bool = False

    def trains(self, leaf: str) -> bool:
        return leaf in self.base or leaf in self.adapters

    def reads_input(self, leaf: str) -> bool:
        """The linear ``leaf`` keeps its input: its weight's gradient, or an undropped adapter's A, reads it."""
        return leaf in self.base or (leaf in self.adapters and not self.dropout)

    @property
    def output(self) -> bool:
        """The layer's output requires grad: its input does (the residual carries it) or something in it trains."""
        return self.input or bool(self.base) or bool(self.adapters)


ALL_TRAIN = LayerGrads()


@dataclass(frozen=True)
class GradPlan:
    """The gradients of a fine-tuning run, module by module (``None`` from ``grad_plan`` when everything trains)."""

    embedding: frozenset[str]  # first-stage modules that train
    layers: tuple[LayerGrads, ...]  # layer i with its input as in one process (the chain from the embeddings)
    tail: frozenset[str]  # last-stage modules that train (model_names.TAIL_NAMES; a tied head trains with tok_emb)

    def layer(self, i: int, staged: bool) -> LayerGrads:
        """Layer i; ``staged``: on a pipeline stage after the first, whose received input always requires grad."""
        return dataclasses.replace(self.layers[i], input=True) if staged else self.layers[i]

    def head_input(self, staged: bool) -> bool:
        """Whether the last layer's output (the final norm's input) requires grad."""
        return staged or self.layers[-1].output


def head_trains(plan: GradPlan | None) -> bool:
    """Whether the output weight has a gradient (a tied head trains with ``tok_emb``); ``plan`` from ``grad_plan``."""
    return plan is None or "head" in plan.tail


def grad_plan(cfg: ModelConfig, freeze: Sequence[str] = ()) -> GradPlan | None:
    """Each layer's ``LayerGrads`` in one process, chained from the embeddings; None when everything trains."""
    if not cfg.lora_rank and not freeze:
        return None
    plan = module_training(cfg, freeze)
    embedding = frozenset(n for n in FIRST_STAGE_MODULES if plan.get(n, (False, False))[0])
    grad = bool(embedding)
    layers = []
    for i in range(cfg.n_layers):
        names = {leaf: layer_module_name(i, leaf) for leaf in LAYER_MODULES}
        base = frozenset(leaf for leaf, n in names.items() if plan.get(n, (False, False))[0])
        if cfg.is_moe_layer(i) and any(plan[n][0] for n in moe_module_names(cfg, i)):
            base |= frozenset(MLP_LEAVES)  # the moe block as one unit (module docstring)
        adapters = frozenset(leaf for leaf, n in names.items() if plan.get(n, (False, False))[1])
        layers.append(LayerGrads(grad, base, adapters, cfg.lora_rank, cfg.lora_dropout > 0))
        grad = layers[-1].output
    tail = {n for n in TAIL_NAMES if plan.get(n, (False, False))[0]}
    if cfg.tie_embeddings and "tok_emb" in embedding:
        tail.add("head")  # the tied head is the token embedding
    return GradPlan(embedding, tuple(layers), frozenset(tail))


def trainable_params(cfg: ModelConfig, freeze: Sequence[str] = (), *, tp_size: int = 1,
                     layer_ids: Sequence[int] | None = None, first: bool = True, last: bool = True,
                     pp_size: int = 1, ep_size: int = 1, ep_rank: int | None = None) -> int:
    """Trainable parameters on one rank: its TP share of the embeddings (``first``), of the layers ``layer_ids``
    (default: all) and of the tail (``last``; a tied head copy when pp_size > 1). A MoE layer's router and shared
    expert count whole, its experts those of ep rank ``ep_rank`` (``trainable_expert_params``)."""
    plan = module_training(cfg, freeze)
    n_enc = cfg.n_layers
    ids = range(n_enc + cfg.n_decoder_layers) if layer_ids is None else layer_ids
    base, adapters = layer_params(cfg, tp_size), lora_layer_params(cfg, tp_size)
    total = sum(base[leaf] * plan.get(layer_module_name(i, leaf), (False, False))[0]
                + adapters[leaf] * plan.get(layer_module_name(i, leaf), (False, False))[1]
                for i in ids if i < n_enc for leaf in LAYER_MODULES)
    if cfg.encoder_decoder:  # decoder layer j is global layer n_layers + j; the stack's modules beside its ends
        total += _decoder_trainable(cfg, plan, tp_size, [i - n_enc for i in ids if i >= n_enc],
                                    encoder_end=n_enc - 1 in ids, first=first)
    block = moe_block_params(cfg) if cfg.n_experts else {}
    total += sum(v * plan[f"layers.{i}.moe.{k}"][0] for i in ids if cfg.is_moe_layer(i)
                 for k, v in block.items() if v and not k.startswith("experts."))
    total += trainable_expert_params(cfg, freeze, layer_ids=ids, ep_size=ep_size, ep_rank=ep_rank)
    if first:
        total += sum(v for n, v in embedding_params(cfg, tp_size).items() if plan.get(n, (False, False))[0])
    if last:
        for n, v in tail_params(cfg, tp_size, pp_size=pp_size).items():
            owner = "tok_emb" if n == "head" and cfg.tie_embeddings else n  # a tied head trains with the embedding
            total += v * plan.get(owner, (False, False))[0]
    return total


def _decoder_trainable(cfg: ModelConfig, plan: dict[str, tuple[bool, bool]], tp_size: int, decoder_ids: list[int],
                       *, encoder_end: bool, first: bool) -> int:
    """An encoder-decoder rank's trainable decoder-side parameters: its decoder layers, ``enc_norm`` with the
    encoder's last layer, the decoder's position tables on the first stage (which embeds both stacks' inputs)."""
    base, adapters = decoder_layer_params(cfg, tp_size), lora_layer_params(cfg, tp_size, decoder=True)
    total = sum(base[k] * plan.get(layer_module_name(j, k, "dec_layers"), (False, False))[0]
                + adapters[k] * plan.get(layer_module_name(j, k, "dec_layers"), (False, False))[1]
                for j in decoder_ids for k in DECODER_LAYER_MODULES)
    if encoder_end:
        total += sum(v * plan.get(n, (False, False))[0] for n, v in encoder_last_params(cfg).items())
    if first:
        total += sum(v * plan.get(n, (False, False))[0] for n, v in decoder_first_params(cfg, tp_size).items())
    return total


def module_rows(cfg: ModelConfig, freeze: Sequence[str] = ()) -> dict[str, int]:
    """Trainable parameters per module kind, keyed as ``params.ParamBreakdown.rows`` (summed over the layers)."""
    plan = module_training(cfg, freeze)
    rows = {f"embedding.{n}": v for n, v in embedding_params(cfg).items() if plan.get(n, (False, False))[0]}
    base, adapters = layer_params(cfg), lora_layer_params(cfg)
    for leaf in LAYER_MODULES:
        names = [layer_module_name(i, leaf) for i in range(cfg.n_layers)]
        rows[f"layers.*.{leaf}"] = base[leaf] * sum(plan.get(n, (False, False))[0] for n in names)
        rows[f"layers.*.{leaf}.lora"] = adapters[leaf] * sum(plan.get(n, (False, False))[1] for n in names)
    moe_ids = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    for k, v in (moe_block_params(cfg) if moe_ids else {}).items():  # every expert counted: total, not active
        subs = [k.replace("*", str(e)) for e in range(cfg.n_experts)] if k.startswith("experts.") else [k]
        names = [f"layers.{i}.moe.{sub}" for i in moe_ids for sub in subs]
        rows[f"layers.*.moe.{k}"] = v * sum(plan[n][0] for n in names) if v else 0
    if cfg.encoder_decoder:
        rows.update({n: v for n, v in encoder_last_params(cfg).items() if plan.get(n, (False, False))[0]})
        rows.update({f"decoder.{n}": v for n, v in decoder_first_params(cfg).items() if plan.get(n, (False, False))[0]})
        base, adapters = decoder_layer_params(cfg), lora_layer_params(cfg, decoder=True)
        for k in DECODER_LAYER_MODULES:
            names = [layer_module_name(j, k, "dec_layers") for j in range(cfg.n_decoder_layers)]
            rows[f"dec_layers.*.{k}"] = base[k] * sum(plan.get(n, (False, False))[0] for n in names)
            rows[f"dec_layers.*.{k}.lora"] = adapters[k] * sum(plan.get(n, (False, False))[1] for n in names)
    rows.update({n: v for n, v in tail_params(cfg).items() if plan.get(n, (False, False))[0]})
    return rows
