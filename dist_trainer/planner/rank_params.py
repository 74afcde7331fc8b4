"""Parameters one rank holds in a (tp, pp) layout: planner/params.py's module counts cut by the trainer's rules.

Megatron's TP plan (Shoeybi et al. 2019, section 3) splits the layers' linears and the vocabulary; norms,
row-parallel biases, position/type embeddings, the pooler, the MLM transform and (when tp does not divide the kv
heads) k/v are replicated on every TP rank. The pipeline split is ``layout_rules.layers_per_stage``, as the
trainer builds it.
A MoE layer's ``moe`` block is replicated on the TP ranks and, under expert parallelism, holds n_experts / ep
experts (``planner/moe.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_names import MLP_LEAVES
from dist_trainer.facts.model_shape import (
    decoder_first_params,
    decoder_layer_params,
    embedding_params,
    encoder_last_params,
    kv_sharded,
    layer_params,
    layer_replicated_params,
    norm_params,
    tail_params,
)
from dist_trainer.layout_rules import check_tp, layers_per_stage, rank_layer_ids
from dist_trainer.planner.moe import largest_moe_module, moe_holdings, moe_layer_ids
from dist_trainer.planner.params import lora_layer_params, lora_replicated_params

VOCAB_PARALLEL_TAIL = ("head", "output_bias")  # the tail's vocab-sharded rows; the rest is whole on every TP rank


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one rank of a (tp, pp) grid; ``replicated`` are identical on every TP rank."""

    modules: dict[str, int]
    sharded: int
    replicated: int
    largest_layer: int  # the biggest single module, for ZeRO-3's gathered working set
    expert: int = 0  # of the total: expert-parallel experts (model states reduced over edp, not dp)

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def rank_params(cfg: ModelConfig, *, tp_size: int = 1, pp_size: int = 1, pp_rank: int = 0,
                stage_layers: Sequence[int] | None = None, virtual_stages: int = 1,
                balance: str = "layers", ep_size: int = 1) -> RankParams:
    """Parameters on one rank of pipeline rank ``pp_rank`` (identical for every TP rank of the stage).

    The layers are the trainer's split (``layout_rules``): pp_size x virtual_stages stages by ``balance`` or
    ``stage_layers``, rank r holding stages r, r + pp_size, ... (the loop placement of the interleaved schedule).
    """
    cfg.validate()
    check_tp(cfg, tp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, {pp_size})")
    counts = layers_per_stage(cfg, pp_size * virtual_stages, balance,
                              None if stage_layers is None else list(stage_layers))
    modules: dict[str, int] = {}
    replicated = 0
    one_layer = layer_params(cfg, tp_size)
    rep_layer = layer_replicated_params(cfg, tp_size)  # norms, row-parallel biases, unsplit k/v
    if pp_rank == 0:
        emb = embedding_params(cfg, tp_size)
        modules.update({f"embedding.{k}": v for k, v in emb.items() if v})
        if tp_size > 1:
            replicated += emb["pos_emb"] + emb["type_emb"] + emb["emb_norm"]
    all_ids = rank_layer_ids(counts, pp_rank, pp_size)
    ids = [i for i in all_ids if i < cfg.n_layers]  # an encoder-decoder's decoder layers: _decoder_holdings
    n_here, n_moe = len(ids), len(moe_layer_ids(cfg, ids))
    for name, v in one_layer.items():
        n = n_here - n_moe if name in MLP_LEAVES else n_here  # a MoE layer has ``moe`` for its MLP
        if v and n:
            modules[f"layers.*.{name}"] = v * n
    for name, v in lora_layer_params(cfg, tp_size).items():  # LoRA adapters (none without model.lora_rank)
        n = n_here - n_moe if name in MLP_LEAVES else n_here  # (a MoE model takes attention targets only)
        if v and n:
            modules[f"layers.*.{name}.lora"] = v * n
    replicated += rep_layer * (n_here - n_moe) + lora_replicated_params(cfg, tp_size) * n_here
    moe = moe_holdings(cfg, n_moe, ep_size)
    modules.update(moe.modules)
    if tp_size > 1 and n_moe:  # the block is whole on every TP rank; the layer has no down_proj bias
        replicated += layer_replicated_params(cfg, tp_size, mlp=False) * n_moe + moe.replicated
    if cfg.encoder_decoder:
        dec_modules, dec_replicated = _decoder_holdings(cfg, tp_size, all_ids, first=pp_rank == 0)
        modules.update(dec_modules)
        replicated += dec_replicated
    if pp_rank == pp_size - 1:
        tail = tail_params(cfg, tp_size, pp_size=pp_size)
        modules.update({k: v for k, v in tail.items() if v})
        if tp_size > 1:
            replicated += sum(v for k, v in tail.items() if k not in VOCAB_PARALLEL_TAIL)
    total = sum(modules.values())
    largest = max([*one_layer.values(), *embedding_params(cfg, tp_size).values(),
                   *(decoder_layer_params(cfg, tp_size).values() if cfg.encoder_decoder else ()),
                   *tail_params(cfg, tp_size, pp_size=pp_size).values(), largest_moe_module(cfg) if n_moe else 0])
    return RankParams(modules=modules, sharded=total - replicated, replicated=replicated, largest_layer=largest,
                      expert=moe.expert)


def _decoder_holdings(cfg: ModelConfig, tp_size: int, ids: Sequence[int], *, first: bool) -> tuple[dict[str, int], int]:
    """(modules, replicated) of an encoder-decoder rank beyond its encoder layers: ``enc_norm`` with the encoder's
    last layer, the decoder's position tables on the first stage (it embeds both stacks' inputs; a relative table is
    split by head, a learned one whole), its decoder layers (norms, row-parallel biases and unsplit k/v whole on
    every TP rank, for self- and cross-attention alike)."""
    n_dec = sum(1 for i in ids if i >= cfg.n_layers)
    modules: dict[str, int] = {}
    replicated = 0
    if cfg.n_layers - 1 in ids:
        modules.update({k: v for k, v in encoder_last_params(cfg).items() if v})
        replicated += sum(encoder_last_params(cfg).values()) if tp_size > 1 else 0
    if first:
        tables = decoder_first_params(cfg, tp_size)
        modules.update({f"decoder.{k}": v for k, v in tables.items() if v})
        replicated += tables["dec_pos_emb"] if tp_size > 1 else 0
    layer = decoder_layer_params(cfg, tp_size)
    modules.update({f"dec_layers.*.{k}": v * n_dec for k, v in layer.items() if v and n_dec})
    adapters = lora_layer_params(cfg, tp_size, decoder=True)
    modules.update({f"dec_layers.*.{k}.lora": v * n_dec for k, v in adapters.items() if v and n_dec})
    if tp_size > 1:
        # the self-attention layer's, and cross-attention's norm, o bias and unsplit k/v
        per_layer = layer_replicated_params(cfg, tp_size) + norm_params(cfg)
        per_layer += int(cfg.linear_bias("out")) * cfg.d_model
        if not kv_sharded(cfg, tp_size):
            per_layer += layer["cross_attn.k_proj"] + layer["cross_attn.v_proj"]
        replicated += (per_layer + lora_replicated_params(cfg, tp_size, decoder=True)) * n_dec
    return modules, replicated
