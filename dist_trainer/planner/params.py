"""Exact parameter counts of dist_trainer.model.Transformer, per module kind, per rank.

The closed form of each module on one TP rank (Megatron-LM's sharding, the vocabulary padded to a multiple of
tp) is ``model_shape.py``'s, which the TP layers and the pipeline split read too; here they are summed per module
kind, with the LoRA adapters, and the matmul weights the cost model prices.

Pipeline parallelism: the embeddings sit on the first stage, final norm + head (+ MLM head, pooler) on the last;
with tied embeddings and pp > 1 the last stage keeps its own copy of the embedding as its head (Megatron
keeps a word-embedding copy on the last stage and all-reduces its gradient with the first).

Encoder-decoder (``model.n_decoder_layers`` > 0, ``model_seq2seq.py``): the encoder's layers are ``layers``, then
``enc_norm``, the decoder's own position tables, and ``dec_layers`` (each a layer plus cross-attention: a norm and
its own q/k/v/o); the token embedding is shared by both stacks and, tied, by the head. T5-small: 60,506,624 (shared
embedding 16,449,536; encoder 18,880,512 + relative table 256 + final norm 512; decoder 25,175,040 + 256 + 512).

Mixture of experts (``dist_trainer/model_moe.py``): a MoE layer has the dense layer's attention and norms, and in
place of the MLP a router ``Linear(h, E, bias=False)``, E experts that are each the MLP, and an optional shared
expert (an MLP n_shared_experts x moe_d_ff wide, and Qwen's gate). Per token only top_k experts run: the *active*
count is the total less (E - top_k) experts per MoE layer (Mixtral 8x7B: 46,702,792,704 total, 12,879,925,248
active, the whole
embedding table and the untied head included, as Mistral counts them).
LoRA (``model.lora_rank`` r > 0, Hu et al. 2021): each target linear (in k, out d) adds A (r x k) and B (d x r).
Under TP a column-parallel target keeps A whole and splits B's rows, a row-parallel one splits A's columns and
keeps B whole (``parallel/tp/layers.attach_adapter``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dist_trainer.config import ModelConfig
from dist_trainer.facts.finetune import lora_target_leaves
from dist_trainer.facts.mla_shape import mla_matmul_weights
from dist_trainer.facts.model_names import DECODER_LAYER_MODULES, LAYER_MODULES, MLP_LEAVES
from dist_trainer.facts.model_shape import (
    decoder_first_params,
    decoder_layer_params,
    embedding_params,
    encoder_last_params,
    kv_local_dim,
    kv_sharded,
    layer_params,
    moe_block_params,
    tail_params,
)


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of one routed expert."""
    return sum(v for k, v in moe_block_params(cfg).items() if k.startswith("experts."))


def lora_shapes(cfg: ModelConfig, tp_size: int = 1) -> dict[str, tuple[int, int, bool, bool]]:
    """Per layer linear leaf: (A's input columns, B's output rows, A whole, B whole) on one TP rank."""
    h, t, f, q = cfg.d_model, tp_size, cfg.ffn_dim, cfg.q_dim
    split = kv_sharded(cfg, t)
    kv_local = kv_local_dim(cfg, t)
    return {"q_proj": (h, q // t, True, t == 1), "k_proj": (h, kv_local, True, t == 1 or not split),
            "v_proj": (h, kv_local, True, t == 1 or not split), "o_proj": (q // t, h, t == 1, True),
            "up_proj": (h, f // t, True, t == 1), "gate_proj": (h, f // t, True, t == 1),
            "down_proj": (f // t, h, t == 1, True)}


def lora_layer_params(cfg: ModelConfig, tp_size: int = 1, decoder: bool = False) -> dict[str, int]:
    """Adapter parameters of one layer on one TP rank, keyed like ``layer_params`` (``decoder``: like
    ``decoder_layer_params``, cross-attention linears adapted as the self-attention's), 0 where no adapter."""
    targets = lora_target_leaves(cfg)
    shapes = lora_shapes(cfg, tp_size)

    def count(key: str) -> int:
        leaf = key.rpartition(".")[2]
        return cfg.lora_rank * (shapes[leaf][0] + shapes[leaf][1]) if leaf in targets else 0

    return {key: count(key) for key in (DECODER_LAYER_MODULES if decoder else LAYER_MODULES)}


def lora_replicated_params(cfg: ModelConfig, tp_size: int, decoder: bool = False) -> int:
    """Adapter parameters of one layer that every TP rank keeps whole (A of column targets, B of row targets);
    ``decoder``: an encoder-decoder's decoder layer, whose cross-attention linears are adapted as self-attention's."""
    if tp_size == 1:
        return 0
    shapes = lora_shapes(cfg, tp_size)
    leaves = [*lora_target_leaves(cfg)]
    if decoder:
        leaves += [leaf for leaf in lora_target_leaves(cfg) if leaf in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return sum(cfg.lora_rank * (shapes[leaf][0] * shapes[leaf][2] + shapes[leaf][1] * shapes[leaf][3])
               for leaf in leaves)


@dataclass(frozen=True)
class ParamBreakdown:
    """Per-module counts: embeddings (once), one dense layer (times n_layers), tail (once), LoRA adapters per
    layer; a MoE model adds n_moe_layers layers of attention and norms (per_layer's non-MLP modules) and ``moe``
    (moe_block_params)."""

    embedding: dict[str, int]
    per_layer: dict[str, int]
    n_layers: int  # dense layers
    tail: dict[str, int]
    n_moe_layers: int = 0
    moe: dict[str, int] = field(default_factory=dict)
    n_experts: int = 0
    top_k: int = 0
    adapters: dict[str, int] = field(default_factory=dict)  # per layer, by the linear they adapt
    # an encoder-decoder (model.n_decoder_layers > 0): its encoder's last module, the decoder's position tables, one
    # decoder layer (times n_decoder_layers) and its adapters; per_layer and n_layers are the encoder's
    encoder_last: dict[str, int] = field(default_factory=dict)
    decoder_first: dict[str, int] = field(default_factory=dict)
    decoder_layer: dict[str, int] = field(default_factory=dict)
    n_decoder_layers: int = 0
    decoder_adapters: dict[str, int] = field(default_factory=dict)

    @property
    def layer_total(self) -> int:
        return sum(self.per_layer.values()) + sum(self.adapters.values())

    @property
    def decoder_layer_total(self) -> int:
        return sum(self.decoder_layer.values()) + sum(self.decoder_adapters.values())

    @property
    def total(self) -> int:
        return sum(r[3] for r in self.rows())

    @property
    def base_total(self) -> int:
        """The model without its adapters."""
        return self.total - sum(r[3] for r in self.rows() if r[0].endswith(".lora"))

    def stacks(self) -> dict[str, int]:
        """An encoder-decoder's totals by part: the shared token embedding, the encoder (its layers, position
        table, final norm), the decoder (its layers, position tables, final norm), the cross-attention within the
        decoder, an untied head; {} for one stack."""
        if not self.n_decoder_layers:
            return {}
        rows = {r[0]: r[3] for r in self.rows()}
        decoder = sum(v for k, v in rows.items() if k.startswith(("dec_layers.", "decoder.")) or k == "final_norm")
        return {"shared token embedding": rows.get("embedding.tok_emb", 0),
                "encoder": sum(v for k, v in rows.items() if k.startswith(("layers.", "embedding.")) or k == "enc_norm")
                - rows.get("embedding.tok_emb", 0),
                "decoder": decoder,
                "  of which cross-attention": sum(v for k, v in rows.items() if ".cross_" in k),
                "head (untied)": rows.get("head", 0)}

    @property
    def active(self) -> int:
        """Parameters that take part in one token's forward: all but the experts it is not routed to."""
        return sum(r[4] for r in self.rows(active=True))

    def rows(self, active: bool = False) -> list[tuple]:
        """(module, count per instance, instances, count in total[, active per token]) for every non-empty
        module; an expert's projection is one instance per expert and MoE layer."""
        n_moe = self.n_moe_layers
        out = [(f"embedding.{k}", v, 1, v) for k, v in self.embedding.items() if v]
        for k, v in self.per_layer.items():
            n = self.n_layers + (n_moe if k not in MLP_LEAVES else 0)  # a MoE layer's MLP is its ``moe``
            if v and n:
                out.append((f"layers.*.{k}", v, n, v * n))
            a = self.adapters.get(k, 0)
            if a and n:
                out.append((f"layers.*.{k}.lora", a, n, a * n))
        for k, v in self.moe.items():
            n = n_moe * (self.n_experts if k.startswith("experts.") else 1)
            if v and n:
                out.append((f"layers.*.moe.{k}", v, n, v * n))
        out += [(k, v, 1, v) for k, v in self.encoder_last.items() if v]
        out += [(f"decoder.{k}", v, 1, v) for k, v in self.decoder_first.items() if v]
        n_dec = self.n_decoder_layers
        for k, v in self.decoder_layer.items():
            if v:
                out.append((f"dec_layers.*.{k}", v, n_dec, v * n_dec))
            a = self.decoder_adapters.get(k, 0)
            if a:
                out.append((f"dec_layers.*.{k}.lora", a, n_dec, a * n_dec))
        out += [(k, v, 1, v) for k, v in self.tail.items() if v]
        if not active:
            return out
        share = {".moe.experts.": self.top_k / max(self.n_experts, 1)}
        return [(*r, round(r[3] * next((f for key, f in share.items() if key in r[0]), 1))) for r in out]


def param_breakdown(cfg: ModelConfig) -> ParamBreakdown:
    """The whole model's counts (single rank); ``.total`` equals count_parameters(build_model(cfg))."""
    cfg.validate()
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    seq2seq = cfg.encoder_decoder
    return ParamBreakdown(embedding_params(cfg), layer_params(cfg), cfg.n_layers - n_moe, tail_params(cfg),
                          n_moe, moe_block_params(cfg) if n_moe else {}, cfg.n_experts, cfg.top_k,
                          lora_layer_params(cfg), encoder_last_params(cfg), decoder_first_params(cfg),
                          decoder_layer_params(cfg) if seq2seq else {}, cfg.n_decoder_layers,
                          lora_layer_params(cfg, decoder=True) if seq2seq else {})


def count_params(cfg: ModelConfig) -> int:
    """Unique parameters of the model (a tied head counts once)."""
    return param_breakdown(cfg).total


def mlp_matrices(cfg: ModelConfig) -> int:
    """Weight matrices of one MLP: up, gate and down when gated (SwiGLU, GEGLU), up and down otherwise."""
    return 3 if cfg.gated else 2


def mlp_weights(cfg: ModelConfig) -> int:
    """Matmul weights of one (dense) MLP, d_model x d_ff each."""
    return mlp_matrices(cfg) * cfg.d_model * cfg.ffn_dim


def layer_matmul_weights(cfg: ModelConfig) -> int:
    """Matmul weights of one dense layer: q and o (h x n_heads * head_dim), k and v (h x kv heads' width), the MLP;
    latent attention's projections (``mla_shape.mla_matmul_weights``) in place of q/k/v/o."""
    if cfg.mla:
        return mla_matmul_weights(cfg) + mlp_weights(cfg)
    h = cfg.d_model
    return 2 * h * cfg.q_dim + 2 * h * cfg.kv_heads * cfg.head_dim + mlp_weights(cfg)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every layer's linears, the MLM transform and the output
    projection.

    Embedding lookups, norms and biases do no matmul; the head (tied or not) does, and so does BERT's MLM transform
    (the pooler takes no part in the MLM loss). Used by cost.py.
    """
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    # a MoE layer's token meets the router (and the shared expert's gate), top_k experts and the shared expert
    # (moe_d_ff wide each) instead of one MLP
    expert = mlp_weights(cfg) * cfg.expert_ffn_dim // cfg.ffn_dim
    moe = cfg.d_model * (cfg.n_experts + cfg.shared_expert_gate) + expert * (cfg.top_k + cfg.n_shared_experts) \
        - mlp_weights(cfg) if n_moe else 0
    return cfg.n_layers * layer_matmul_weights(cfg) + n_moe * moe + head_matmul_weights(cfg)


def head_matmul_weights(cfg: ModelConfig) -> int:
    """Matmul weights after the layers per token: the output projection, and the MLM transform's dense."""
    return cfg.vocab_size * cfg.d_model + (cfg.d_model * cfg.d_model if cfg.mlm_head else 0)
