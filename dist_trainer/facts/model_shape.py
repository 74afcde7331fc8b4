"""The model's shape arithmetic, asked by the planner and the mechanisms alike (torch-free).

Closed forms read off the module definitions in ``model.py`` and ``model_moe.py``, per module, on one TP rank:
``nn.Linear(i, o, bias)`` holds ``i*o (+ o)``, ``nn.Embedding(n, h)`` ``n*h``, a LayerNorm ``h (+ h)``, an RMSNorm
``h``; RoPE and sinusoidal positions are buffers. Attention is ``n_heads * head_dim`` wide (``q_dim``), which need not
be ``d_model``; biases are per group (``cfg.linear_bias``: qkv, out, mlp). Megatron-LM's TP (Shoeybi
et al. 2019, section 3): q/k/v and MLP up/gate column-parallel (their biases split with their rows), o/down
row-parallel (biases replicated), the token embedding, an untied head and the MLM output bias vocab-parallel over a
vocabulary padded up to a multiple of tp; k/v are split when tp divides the kv heads, replicated otherwise. QK-norm
``head`` (one RMSNorm(head_dim) shared by the heads) is replicated; ``full`` (over all of q's, and k's, features) is
split with q's columns, and with k's when k is split (replicated with it otherwise). Every norm but a QK-norm is
replicated. A MoE layer holds a router, n_experts MLPs and an optional shared expert in place of
the MLP, never split by TP. The TP layers (``parallel/tp``), the pipeline split (``layout_rules``) and the planner's
counts (``planner/params.py``) read these, so they cannot drift apart.
"""

from __future__ import annotations

from typing import Protocol

from dist_trainer.facts.mla_shape import MLA_MODULES, MLAShape, mla_params, mla_replicated_params
from dist_trainer.facts.model_names import CROSS_ATTENTION_MODULES, MLP_LEAVES


class ModelShape(MLAShape, Protocol):
    """The fields of ``config.ModelConfig`` that decide which modules exist and their sizes (config.py imports
    this module, so they are named here structurally)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    max_seq_len: int
    pos_embedding: str
    n_token_types: int
    norm: str
    norm_placement: str
    qk_norm: str
    activation: str
    bias: bool
    tie_embeddings: bool
    pooler: bool
    mlm_head: bool
    nsp_head: bool
    lora_rank: int
    lora_targets: list[str]
    n_experts: int
    moe_every: int
    moe_dense_layers: list[int]
    n_shared_experts: int
    shared_expert_gate: bool
    n_decoder_layers: int
    rel_buckets: int

    @property
    def head_dim(self) -> int: ...

    @property
    def q_dim(self) -> int: ...

    def linear_bias(self, group: str) -> bool: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def ffn_dim(self) -> int: ...

    @property
    def expert_ffn_dim(self) -> int: ...

    @property
    def gated(self) -> bool: ...

    @property
    def encoder_decoder(self) -> bool: ...


def is_moe_layer(cfg: ModelShape, layer: int) -> bool:
    """Whether layer ``layer`` (0-based) is a mixture-of-experts layer (the rule's one home;
    ``ModelConfig.is_moe_layer`` asks here)."""
    return cfg.n_experts > 0 and layer % cfg.moe_every == 0 and layer not in cfg.moe_dense_layers


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """Vocabulary rows after padding up to a multiple of tp (so every rank holds the same slice)."""
    return -(-vocab_size // tp_size) * tp_size


def kv_sharded(cfg: ModelShape, tp_size: int) -> bool:
    """True when tp divides the kv heads (split); False: every rank keeps all kv heads (replicated)."""
    return cfg.kv_heads % tp_size == 0


def norm_params(cfg: ModelShape, width: int | None = None) -> int:
    """A norm over ``width`` features (default d_model): RMSNorm a weight, LayerNorm a weight and, with model.bias,
    a bias."""
    n = cfg.d_model if width is None else width
    if cfg.norm == "rmsnorm":
        return n  # RMSNorm: weight only
    return n * (2 if cfg.bias else 1)  # LayerNorm(bias=cfg.bias)


def has_final_norm(cfg: ModelShape) -> bool:
    """Every placement but post-norm (BERT: the last residual add is normalised in the layer) ends with final_norm."""
    return cfg.norm_placement != "post"


def kv_local_dim(cfg: ModelShape, tp_size: int = 1) -> int:
    """Width of k (and of v) on one TP rank: kv_heads * head_dim, split when tp divides the kv heads."""
    kv_dim = cfg.kv_heads * cfg.head_dim
    return kv_dim // tp_size if kv_sharded(cfg, tp_size) else kv_dim


def vocab_rows(cfg: ModelShape, tp_size: int = 1) -> int:
    """The vocabulary rows of the token table, the head and the logits on one TP rank (padded to a multiple of tp)."""
    return padded_vocab(cfg.vocab_size, tp_size) // tp_size if tp_size > 1 else cfg.vocab_size


def token_embedding_params(cfg: ModelShape, tp_size: int = 1) -> int:
    """The token table on one TP rank: vocabulary rows split (padded to a multiple of tp)."""
    return vocab_rows(cfg, tp_size) * cfg.d_model


def relative_bias_params(cfg: ModelShape, tp_size: int = 1) -> int:
    """One stack's relative-position table (buckets x heads) on one TP rank: split by head, as the attention."""
    return cfg.rel_buckets * cfg.n_heads // tp_size if cfg.pos_embedding == "relative" else 0


def embedding_params(cfg: ModelShape, tp_size: int = 1) -> dict[str, int]:
    """Parameters of the first-stage embedding modules on one TP rank (a post-norm model, BERT, normalises the
    embedding sum in ``emb_norm``; an encoder-decoder's stacks have no embedding norm)."""
    h = cfg.d_model
    return {
        "tok_emb": token_embedding_params(cfg, tp_size),
        "pos_emb": cfg.max_seq_len * h if cfg.pos_embedding == "learned" else 0,
        "type_emb": cfg.n_token_types * h,
        "rel_emb": relative_bias_params(cfg, tp_size),
        "emb_norm": norm_params(cfg) if cfg.norm_placement == "post" and not cfg.encoder_decoder else 0,
    }


def encoder_last_params(cfg: ModelShape) -> dict[str, int]:
    """An encoder-decoder's encoder closes with ``enc_norm`` (pre-norm; replicated under TP); {} for one stack."""
    if not cfg.encoder_decoder:
        return {}
    return {"enc_norm": norm_params(cfg) if cfg.norm_placement == "pre" else 0}


def decoder_first_params(cfg: ModelShape, tp_size: int = 1) -> dict[str, int]:
    """The decoder stack's own position tables (its token embedding is ``tok_emb``); {} for one stack."""
    if not cfg.encoder_decoder:
        return {}
    return {"dec_pos_emb": cfg.max_seq_len * cfg.d_model if cfg.pos_embedding == "learned" else 0,
            "dec_rel_emb": relative_bias_params(cfg, tp_size)}


def attention_params(cfg: ModelShape, tp_size: int = 1) -> dict[str, int]:
    """One attention block's projections on one TP rank: q/k/v column-parallel (k/v split when tp divides the kv
    heads) with their biases (model.attn_qkv_bias), o row-parallel (q_dim -> d_model) with its bias
    (model.attn_out_bias) replicated, added after the all-reduce. Latent attention (model.kv_lora_rank > 0):
    ``mla_shape.mla_params``'s modules instead."""
    if cfg.kv_lora_rank:
        mla = mla_params(cfg, tp_size)
        return {"q_proj": mla.pop("q_proj"), "k_proj": 0, "v_proj": 0, **mla}
    h, qkv_bias, out_bias = cfg.d_model, int(cfg.linear_bias("qkv")), int(cfg.linear_bias("out"))
    q_local, kv_local = cfg.q_dim // tp_size, kv_local_dim(cfg, tp_size)
    return {"q_proj": h * q_local + qkv_bias * q_local, "k_proj": h * kv_local + qkv_bias * kv_local,
            "v_proj": h * kv_local + qkv_bias * kv_local, **dict.fromkeys(MLA_MODULES[1:-1], 0),
            "o_proj": q_local * h + out_bias * h}


def qk_norm_params(cfg: ModelShape, tp_size: int = 1) -> dict[str, int]:
    """``attn.q_norm`` and ``attn.k_norm`` on one TP rank (RMSNorms, model.qk_norm): ``head`` one head_dim weight
    each, shared by the heads (whole on every rank); ``full`` q_dim and kv_heads * head_dim weights, split as q's and
    k's columns are."""
    if cfg.qk_norm == "none":
        return {"q_norm": 0, "k_norm": 0}
    if cfg.qk_norm == "head":
        return {"q_norm": cfg.head_dim, "k_norm": cfg.head_dim}
    return {"q_norm": cfg.q_dim // tp_size, "k_norm": kv_local_dim(cfg, tp_size)}


def qk_norm_replicated(cfg: ModelShape, tp_size: int) -> int:
    """Of ``qk_norm_params``, what every TP rank holds whole: head norms, and full k_norm when k is replicated."""
    if tp_size == 1 or cfg.qk_norm == "none":
        return 0
    if cfg.qk_norm == "head":
        return 2 * cfg.head_dim
    return 0 if kv_sharded(cfg, tp_size) else cfg.kv_heads * cfg.head_dim


def mlp_params(cfg: ModelShape, width: int, tp_size: int = 1) -> dict[str, int]:
    """An MLP of ``width`` inner features on one TP rank: up and gate column-parallel, down row-parallel (its bias
    replicated, added after the all-reduce)."""
    h, bias, f = cfg.d_model, int(cfg.linear_bias("mlp")), width // tp_size
    return {"up_proj": h * f + bias * f, "gate_proj": (h * f + bias * f) if cfg.gated else 0,
            "down_proj": f * h + bias * h}


def post_norm_params(cfg: ModelShape) -> int:
    """``attn_post_norm`` and ``mlp_post_norm`` each (sandwich placement: the norms after each branch, before its
    residual add)."""
    return norm_params(cfg) if cfg.norm_placement == "sandwich" else 0


def layer_params(cfg: ModelShape, tp_size: int = 1) -> dict[str, int]:
    """Parameters of one (dense) transformer layer on one TP rank (tp validated by ``layout_rules.check_tp``), keyed
    as ``model_names.LAYER_MODULES``; an encoder-decoder's encoder layer. Every placement has attn_norm and mlp_norm
    (post_branch applies them to the branch outputs, parallel_residual both to the block input); sandwich adds the
    two post-branch norms."""
    post = post_norm_params(cfg)
    return {"attn_norm": norm_params(cfg), **attention_params(cfg, tp_size), **qk_norm_params(cfg, tp_size),
            "attn_post_norm": post, "mlp_norm": norm_params(cfg), **mlp_params(cfg, cfg.ffn_dim, tp_size),
            "mlp_post_norm": post}


def layer_replicated_params(cfg: ModelShape, tp_size: int, *, mlp: bool = True) -> int:
    """Of ``layer_params``, what every TP rank holds whole: the norms (QK-norms as ``qk_norm_replicated``), the
    row-parallel biases (o's; down's when ``mlp``, a dense layer's MLP) and k/v when tp does not divide the kv heads.
    0 at tp=1."""
    if tp_size == 1:
        return 0
    layer = layer_params(cfg, tp_size)
    out = layer["attn_norm"] + layer["mlp_norm"] + layer["attn_post_norm"] + layer["mlp_post_norm"]
    out += qk_norm_replicated(cfg, tp_size) + int(cfg.linear_bias("out")) * cfg.d_model
    out += int(cfg.linear_bias("mlp")) * cfg.d_model if mlp else 0
    if cfg.kv_lora_rank:  # latent attention: its down projections and their norms (o's bias is counted above)
        return out + mla_replicated_params(cfg, tp_size) - int(cfg.linear_bias("out")) * cfg.d_model
    if not kv_sharded(cfg, tp_size):
        out += layer["k_proj"] + layer["v_proj"]
    return out


def decoder_layer_params(cfg: ModelShape, tp_size: int = 1) -> dict[str, int]:
    """One decoder layer of an encoder-decoder on one TP rank (``model_names.DECODER_LAYER_MODULES``): the layer's
    modules with cross-attention (its norm, q over the decoder state, k/v over the encoder output, o) between
    self-attention and the MLP, split as self-attention is."""
    layer = layer_params(cfg, tp_size)
    attn = attention_params(cfg, tp_size)
    cross = dict(zip(CROSS_ATTENTION_MODULES, [norm_params(cfg), *(attn[k] for k in ("q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"))], strict=True))
    mlp_from = list(layer).index("mlp_norm")
    return {**dict(list(layer.items())[:mlp_from]), **cross, **dict(list(layer.items())[mlp_from:])}


def moe_block_params(cfg: ModelShape) -> dict[str, int]:
    """A MoE layer's ``moe`` module: ``router``, ONE expert's projections (``experts.*.up_proj``, ...; the layer
    holds n_experts of them, expert_ffn_dim wide), the shared expert (n_shared_experts x expert_ffn_dim wide) and
    its gate (Qwen-MoE). Never split by TP (the block is replicated on TP ranks). The expert bias is a buffer."""
    shared = cfg.n_shared_experts * cfg.expert_ffn_dim
    return {"router": cfg.d_model * cfg.n_experts,
            **{f"experts.*.{k}": v for k, v in mlp_params(cfg, cfg.expert_ffn_dim).items()},
            **{f"shared_expert.{k}": v if shared else 0 for k, v in mlp_params(cfg, shared).items()},
            "shared_expert_gate": cfg.d_model if cfg.shared_expert_gate else 0}


def layer_param_counts(cfg: ModelShape) -> list[int]:
    """Parameters of each layer of the whole model: a dense layer, or attention and norms plus the MoE block with
    all its experts; an encoder-decoder's decoder layers follow its encoder's (global layer n_layers + j)."""
    dense = layer_params(cfg)
    moe = sum(v for k, v in dense.items() if k not in MLP_LEAVES) + sum(
        v * (cfg.n_experts if k.startswith("experts.") else 1) for k, v in moe_block_params(cfg).items())
    decoder = [sum(decoder_layer_params(cfg).values())] * cfg.n_decoder_layers
    return [moe if is_moe_layer(cfg, i) else sum(dense.values()) for i in range(cfg.n_layers)] + decoder


def tail_params(cfg: ModelShape, tp_size: int = 1, *, pp_size: int = 1) -> dict[str, int]:
    """Parameters of the last-stage modules (``model_names.TAIL_NAMES``): final norm, the MLM transform, head
    (untied, or a tied copy when pp > 1), the MLM output bias (vocab-parallel like the head's rows), pooler, the
    next-sentence head (``model.nsp_head``).

    Every placement but post-norm ends with a final norm; an untied head is ``Linear(h, V, bias=False)``; BERT's
    masked-LM head (``model.mlm_head``) adds ``mlm_transform.dense`` ``Linear(h, h, bias)``, its norm and
    ``output_bias``."""
    head_rows = vocab_rows(cfg, tp_size)
    has_head = not cfg.tie_embeddings or pp_size > 1
    dense = cfg.d_model * cfg.d_model + cfg.bias * cfg.d_model  # a Linear(h, h, bias=model.bias)
    return {
        "final_norm": norm_params(cfg) if has_final_norm(cfg) else 0,  # the decoder's, in an encoder-decoder
        "mlm_transform.dense": dense if cfg.mlm_head else 0,
        "mlm_transform.norm": norm_params(cfg) if cfg.mlm_head else 0,
        "head": head_rows * cfg.d_model if has_head else 0,
        "output_bias": head_rows if cfg.mlm_head else 0,
        "pooler": dense if cfg.pooler else 0,
        "nsp_head": 2 * cfg.d_model + 2 if cfg.nsp_head else 0,  # Linear(h, 2) with its bias, whatever model.bias
    }
