"""The ``model`` section of a run's config: the one model definition's shape (decoder, encoder, encoder-decoder,
MoE, LoRA, int8 base), its choices and its own validation. ``config.py`` holds the other sections and the tree."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from dist_trainer.config_fields import choice, is_number, name_list, positive
from dist_trainer.config_mla import validate_mla, validate_yarn
from dist_trainer.config_moe import validate_moe
from dist_trainer.facts.finetune import lora_target_leaves
from dist_trainer.facts.model_shape import is_moe_layer

POS_EMBEDDINGS = ("learned", "sinusoidal", "rope", "relative")
NORMS = ("layernorm", "rmsnorm")
# pre (GPT-2, Llama) | post (BERT: after each residual add) | post_branch (OLMo 2: attn_norm / mlp_norm normalise the
# branch output before its residual add) | sandwich (Gemma 2/3: attn_norm / mlp_norm before the branch and
# attn_post_norm / mlp_post_norm after it, before the add). Every placement but post ends with final_norm.
NORM_PLACEMENTS = ("pre", "post", "post_branch", "sandwich")
QK_NORMS = ("none", "head", "full")  # model.qk_norm
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")  # a gate projection beside up: act(gate(x)) * up(x) (Shazeer 2020)
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
BASE_WEIGHT_DTYPES = ("fp32", "int8")  # model.base_weight_dtype: frozen layer linears as parameters, or int8


@dataclass
class ModelConfig:
    """The one model definition's shape. Presets live in configs/models/*.yaml."""

    SECTION: ClassVar[str] = "model"

    preset: str | None = None  # name of a configs/models/ preset used as the base (applied first)
    # The Hugging Face model_type this model was read from (a folder) or is published as (a preset): export writes
    # that family when it computes the model exactly, else the first family that does (families/__init__.py).
    # Changes no maths; null = none in particular.
    hf_family: str | None = None
    vocab_size: int = 50257  # tokens in the vocabulary (TP pads internally when tp does not divide it)
    d_model: int = 768  # hidden size h
    n_layers: int = 12  # transformer blocks L
    n_heads: int = 12  # attention (query) heads a
    n_kv_heads: int | None = None  # key/value heads: None = n_heads (MHA), 1 = MQA, between = GQA
    d_ff: int | None = None  # MLP inner size; None = 4 * d_model
    max_seq_len: int = 1024  # longest sequence; sizes learned position tables and RoPE caches
    # learned (GPT-2, BERT) | sinusoidal (fixed, Vaswani et al. 2017, section 3.5) | rope (Llama) | relative (T5: a
    # learned bias per head and bucketed distance added to the attention scores; encoder-decoder models only)
    pos_embedding: str = "learned"
    rope_theta: float = 10000.0  # RoPE base frequency
    # RoPE frequency scaling for contexts past the pretraining length (HF's rope_scaling / rope_parameters):
    # none | linear (every inverse frequency / factor: position interpolation, Chen et al. 2023) | llama3 (Llama 3.1:
    # wavelengths above original_max_seq_len / low_freq_factor are stretched by factor, those below
    # original_max_seq_len / high_freq_factor kept, the band between interpolated smoothly)
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0  # linear and llama3: the factor the (long-wavelength) frequencies are divided by
    rope_low_freq_factor: float = 1.0  # llama3: original_max_seq_len / this is the longest wavelength kept unscaled..
    rope_high_freq_factor: float = 4.0  # ..and original_max_seq_len / this the shortest scaled; must exceed low
    rope_original_max_seq_len: int = 8192  # llama3 and yarn: the context length the model was pretrained on
    # yarn (Peng et al. 2023, arXiv 2309.00071; DeepSeek-V3): frequencies blended between kept and divided by factor
    # over the dims rotating between beta_slow and beta_fast times in rope_original_max_seq_len; cos and sin times
    # mscale(factor, rope_yarn_mscale) / mscale(factor, rope_yarn_mscale_all_dim) (mscale(s, m) = 0.1 m ln s + 1;
    # 0 and 0: mscale(factor, 1)), and latent attention's scores times mscale(factor, mscale_all_dim)^2 (model_mla.py)
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 0.0
    rope_yarn_mscale_all_dim: float = 0.0
    norm: str = "layernorm"  # layernorm (GPT-2, BERT) | rmsnorm (Llama)
    norm_eps: float = 1e-5  # epsilon of every norm (BERT uses 1e-12, Llama 1e-5/1e-6)
    norm_placement: str = "pre"  # pre (GPT-2, Llama: final norm) | post (BERT: embedding norm, none final)
    # gelu | gelu_tanh | relu | swiglu (silu-gated: adds a gate projection) | geglu (gelu_tanh-gated: T5 v1.1's
    # gated-gelu, gate = its wi_0, up = its wi_1)
    activation: str = "gelu"
    bias: bool = True  # biases in linears and layernorms (Llama: none)
    # Biases per projection group; None follows model.bias. Qwen2: q/k/v biases without an output bias; Llama and
    # Granite's attention_bias sets both attention groups, mlp_bias the MLP's (and every expert's) linears.
    attn_qkv_bias: bool | None = None  # q_proj, k_proj, v_proj
    attn_out_bias: bool | None = None  # o_proj
    mlp_bias: bool | None = None  # up_proj, gate_proj, down_proj
    # Width of one attention head; None = d_model / n_heads. Qwen3 and Gemma set it apart from d_model: q is
    # n_heads * head_dim wide, k and v kv_heads * head_dim, o_proj maps n_heads * head_dim back to d_model.
    attn_head_dim: int | None = None
    # RMSNorm on q and k after their projections, before RoPE: none | head (over each head's head_dim, one weight
    # shared by the heads: Qwen3, Gemma 3) | full (over all n_heads * head_dim features of q, and of k: OLMo 2).
    # Modules layers.{i}.attn.q_norm and .k_norm.
    qk_norm: str = "none"
    # RMSNorm multiplies by (norm_weight_offset + weight): Gemma stores its norm weights around 0 and uses 1 here
    # (weights then initialise to 0). Applies to every RMSNorm of the model, q/k norms included.
    norm_weight_offset: float = 0.0
    embedding_multiplier: float = 1.0  # token embeddings times this (Granite's embedding_multiplier)
    residual_multiplier: float = 1.0  # each branch output times this before its residual add (Granite)
    # The multiplier of q.k in attention; None: 1/sqrt(head_dim) (1 when attn_scale is false). Granite's
    # attention_multiplier; Gemma 2/3's query_pre_attn_scalar ** -0.5
    attn_score_scale: float | None = None
    logits_divisor: float = 1.0  # the head's logits divided by this (Granite's logits_scaling)
    # Soft-capping (Gemma 2): x -> c * tanh(x / c); 0 = none. attn_softcap on the attention scores (after the
    # scale, before the mask), final_softcap on the head's logits.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Sliding-window attention (Mistral v0.1, StarCoder2, Gemma 2/3 local layers): query i attends to keys j with
    # i - sliding_window < j <= i; 0 = full causal attention.
    sliding_window: int = 0
    # Which layers slide: 0 = every layer; k > 0 = every layer but each k-th ((i + 1) % k == 0 is global: Gemma 2
    # uses 2, Gemma 3 uses 6)
    sliding_window_pattern: int = 0
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, unscaled; None = rope_theta (Gemma 3)
    # GPT-NeoX's parallel residual: x + attn(attn_norm(x)) + mlp(mlp_norm(x)), both branches read the block input
    parallel_residual: bool = False
    rotary_fraction: float = 1.0  # fraction of each head's dims RoPE rotates, the rest pass (GPT-NeoX rotary_pct)
    tie_embeddings: bool = True  # output head shares the token-embedding weight
    dropout: float = 0.0  # dropout on embeddings, attention probabilities and residual branches
    causal: bool = True  # True: decoder, causal-LM objective; False: encoder, masked-LM objective
    n_token_types: int = 0  # BERT segment embeddings (2); 0 = none
    pooler: bool = False  # BERT pooler (dense + tanh on the first token); not used by the MLM loss
    # BERT's masked-LM prediction head (BertForMaskedLM's cls.predictions): before the (tied) output projection,
    # mlm_transform = LayerNorm(activation(dense(x))) (dense h x h, biases and norm as model.bias / model.norm),
    # and the logits get a vocab-sized output_bias. False: the head is the bare projection (BertModel's count)
    mlm_head: bool = False
    # The head and the loss a chunk of this many tokens at a time, forward and backward (model_loss.ChunkedLoss):
    # the full (tokens x vocab) logits are never held. 0 = the whole micro-batch at once
    loss_chunk_tokens: int = 0
    # BERT's next-sentence head (BertForPreTraining's cls.seq_relationship): Linear(h, 2) on the pooled output, so it
    # needs model.pooler. Loaded, exported and counted; the MLM loss gives it no gradient (it stays as loaded
    # unless a loss of its own is added: frozen or trained, it changes only what Transformer.next_sentence returns)
    nsp_head: bool = False
    # Encoder-decoder (Vaswani et al. 2017; T5, Raffel et al. 2020; docs/seq2seq.md). 0: one stack, as above. > 0:
    # n_layers encoder layers (bidirectional self-attention + MLP) then this many decoder layers (causal
    # self-attention, cross-attention over the encoder output, MLP), one token embedding shared by both stacks
    # (and by the head when tied); the objective is data.objective's (span_corruption or seq2seq), and
    # model.causal stays true (it names the decoder-only objective otherwise)
    n_decoder_layers: int = 0
    rel_buckets: int = 32  # pos_embedding=relative: buckets per direction pair (T5: 32; half per side in the encoder)
    rel_max_distance: int = 128  # pos_embedding=relative: distances from this on share the last bucket (T5: 128)
    scale_embeddings: bool = False  # token embeddings * sqrt(d_model) (Vaswani et al. 2017, section 3.4)
    scale_head_input: bool = False  # last hidden state * d_model**-0.5 before the head (T5 with a tied head)
    attn_scale: bool = True  # attention scores / sqrt(head_dim); false: none (T5 folds it into q's initialisation)
    decoder_start_id: int = 0  # encoder-decoder: the decoder's first input token (T5: its pad id 0)
    init_std: float = 0.02  # std of normal init for every weight matrix and embedding
    scaled_residual_init: bool = True  # residual output projections use std / sqrt(2 * n_layers) (GPT-2)
    # Mixture of experts (model_moe.py; docs/moe.md). 0 = dense: every layer has one MLP and nothing below applies.
    n_experts: int = 0  # routed experts per MoE layer, each the model's own MLP (Mixtral: 8)
    top_k: int = 2  # experts per token (Mixtral: 2, Qwen3-30B-A3B: 8, DeepSeek-V3: 8)
    # None (yaml: none) = dropless: every token reaches its top-k experts (Megatron-core's default, Mixtral, Qwen-MoE,
    # DeepSeek-V3); a number = slots per expert and sequence = ceil(factor * top_k * seq_len / n_experts), the rest
    # dropped (GShard, Switch)
    capacity_factor: float | None = None
    moe_every: int = 1  # layer i is MoE when i % moe_every == 0 (Megatron's moe_layer_freq); 1 = every layer
    # layers that keep a dense MLP whatever moe_every says: DeepSeek's first_k_dense_replace (0 .. k-1), Qwen-MoE's
    # mlp_only_layers and the layers its decoder_sparse_step skips
    moe_dense_layers: list[int] = field(default_factory=list)
    moe_d_ff: int | None = None  # one routed expert's inner size; None = d_ff (Qwen-MoE, DeepSeek: smaller)
    # router scores: softmax over the experts (Mixtral, Qwen-MoE) | sigmoid per expert (DeepSeek-V3)
    router_score: str = "softmax"
    norm_topk_prob: bool = True  # the k chosen scores renormalised to sum to 1 (Mixtral; Qwen2-MoE: false)
    routed_scaling_factor: float = 1.0  # the routed experts' gates x this (DeepSeek-V3: 2.5)
    router_groups: int = 1  # experts in this many groups; a token picks from router_topk_groups (DeepSeek-V3: 8, 4)
    router_topk_groups: int = 1  # a group's score is the sum of its 2 best experts' (DeepSeek-V3)
    # a per-expert bias on the scores, for the top-k choice only (DeepSeek-V3's e_score_correction_bias; a buffer
    # kept in checkpoints), nudged toward balance after every step by moe_bias_update_rate (Wang et al. 2024's
    # auxiliary-loss-free balancing: + rate for an expert below the mean load, - rate above); 0 = left as loaded
    expert_bias: bool = False
    moe_bias_update_rate: float = 0.0
    router_aux_loss: float = 0.01  # Switch load-balancing loss coefficient alpha (Fedus et al. 2021, eq. 4)
    router_aux_loss_scope: str = "batch"  # batch: over the micro-batch | sequence: per sequence (DeepSeek-V3 eq. 17)
    router_z_loss: float = 0.001  # router z-loss coefficient c_z (Zoph et al. 2022, eq. 5)
    # always-on experts beside the routed ones (DeepSeekMoE), one MLP this many times moe_d_ff wide
    n_shared_experts: int = 0
    shared_expert_gate: bool = False  # the shared expert's output x sigmoid(Linear(d_model, 1)(x)) (Qwen-MoE)
    # Multi-head latent attention (DeepSeek-V2/V3, model_mla.py; mla_shape.py validates): kv_lora_rank > 0 replaces
    # q/k/v_proj by x -> kv_a_proj -> [c_kv (kv_lora_rank), k_pe (qk_rope_head_dim, one rotated key every head
    # shares)], kv_a_norm(c_kv) -> kv_b_proj -> per head [k_nope (qk_nope_head_dim), v (v_head_dim)], and q by
    # x -> q_a_proj -> q_a_norm -> q_b_proj (q_lora_rank > 0; 0: q_proj from x) -> per head [q_nope, q_pe]
    kv_lora_rank: int = 0  # 0 = ordinary attention, nothing below applies
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # LoRA (Hu et al. 2021, arXiv 2106.09685): every layer's target linears compute W0 x + (alpha / r) B A x with
    # A (r x in) Kaiming-uniform and B (out x r) zero, so step 0 is the base model; the base weights are frozen.
    lora_rank: int = 0  # r; 0 = no adapters
    lora_alpha: float = 16.0  # the update is scaled by alpha / r (Hu et al. section 4.1: tune alpha once, vary r)
    lora_dropout: float = 0.0  # dropout on the adapter's input only; the base path sees the undropped input
    # the layers' linears that get adapters (model_names.LORA_TARGETS), or all_linear; q_proj,v_proj is the paper's
    # choice (section 7.1). A comma-separated string is accepted too.
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    # Frozen base weights in 8 bits (docs/low_bit.md): int8 stores every frozen layer linear (LoRA's base, or one
    # train.freeze covers) as int8 with an fp32 scale per output row and group of base_weight_group input columns,
    # dequantised a block of rows at a time in forward and backward; fp32 keeps them as ordinary parameters.
    base_weight_dtype: str = "fp32"
    # input columns per scale (QLoRA's block of 64); a TP shard's input width must be a multiple of it, so each rank
    # quantises its own shard exactly as the full matrix would be quantised and sliced
    base_weight_group: int = 64

    def __post_init__(self) -> None:
        self.lora_targets = name_list(self.lora_targets)
        if isinstance(self.capacity_factor, str) and self.capacity_factor.lower() in ("none", "null", "dropless"):
            self.capacity_factor = None  # a command line's model.capacity_factor=none

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (model.kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        """Width of one query (and key) head: latent attention's qk_nope_head_dim + qk_rope_head_dim."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.d_model // self.n_heads if self.attn_head_dim is None else self.attn_head_dim

    @property
    def q_dim(self) -> int:
        """Width of q (and of o_proj's input): n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (even): head_dim * rotary_fraction; latent attention's qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.mla else int(self.head_dim * self.rotary_fraction)

    def linear_bias(self, group: str) -> bool:
        """Whether the linears of ``group`` (qkv, out, mlp) have biases."""
        own = {"qkv": self.attn_qkv_bias, "out": self.attn_out_bias, "mlp": self.mlp_bias}[group]
        return self.bias if own is None else own

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) attends within model.sliding_window (the rule's one home)."""
        if not self.sliding_window:
            return False
        return self.sliding_window_pattern == 0 or (layer + 1) % self.sliding_window_pattern != 0

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def gated(self) -> bool:
        """The MLP has a gate projection (swiglu, geglu)."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def encoder_decoder(self) -> bool:
        return self.n_decoder_layers > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is a mixture-of-experts layer: the model, the planner and the
        pipeline split ask here."""
        return is_moe_layer(self, layer)

    @property
    def expert_ffn_dim(self) -> int:
        """One routed expert's inner size (model.moe_d_ff, else the dense MLP's)."""
        return self.ffn_dim if self.moe_d_ff is None else self.moe_d_ff

    @property
    def dropless(self) -> bool:
        """Every token reaches its top-k experts (no capacity)."""
        return self.capacity_factor is None

    def expert_capacity(self, seq_len: int) -> int:
        """Slots of each expert per sequence: ceil(capacity_factor * top_k * seq_len / n_experts) (GShard's
        expert capacity with one group per sequence, so it does not depend on the batch or the layout); dropless:
        the whole sequence (the most one expert can get)."""
        if self.capacity_factor is None:
            return seq_len
        return max(1, math.ceil(self.capacity_factor * self.top_k * seq_len / self.n_experts))

    def validate(self) -> None:
        positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
        if not isinstance(self.loss_chunk_tokens, int) or self.loss_chunk_tokens < 0:
            raise ValueError(f"model.loss_chunk_tokens={self.loss_chunk_tokens!r} must be an integer >= 0 "
                             "(0 = the whole micro-batch at once)")
        choice(self, "pos_embedding", POS_EMBEDDINGS)
        choice(self, "norm", NORMS)
        choice(self, "norm_placement", NORM_PLACEMENTS)
        choice(self, "activation", ACTIVATIONS)
        if self.attn_head_dim is None and not self.mla and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                f"choose n_heads among the divisors of {self.d_model}"
            )
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
                f"n_kv_heads must be a divisor of {self.n_heads} (1 = MQA, {self.n_heads} = MHA)"
            )
        if self.pos_embedding == "rope" and self.head_dim % 2 and not self.mla:
            raise ValueError(f"rope needs an even head_dim, got d_model/n_heads = {self.head_dim}")
        self._validate_family_features()
        self._validate_rope_scaling()
        if not isinstance(self.mlm_head, bool):
            raise ValueError(f"model.mlm_head={self.mlm_head!r} must be true or false")
        if not isinstance(self.nsp_head, bool):
            raise ValueError(f"model.nsp_head={self.nsp_head!r} must be true or false")
        if self.nsp_head and not self.pooler:
            raise ValueError("model.nsp_head=true reads the pooled first token: it needs model.pooler=true")
        if self.mlm_head and self.gated:
            raise ValueError("model.mlm_head=true applies model.activation to one dense layer's output: it needs "
                             f"gelu, gelu_tanh or relu, not the gated {self.activation}")
        if self.pos_embedding == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.ffn_dim < 1:
            raise ValueError(f"model.d_ff={self.d_ff} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.n_token_types < 0:
            raise ValueError(f"model.n_token_types={self.n_token_types} must be >= 0")
        if self.init_std <= 0 or self.norm_eps <= 0:
            raise ValueError(f"model.init_std={self.init_std} and model.norm_eps={self.norm_eps} must be > 0")
        self._validate_moe()
        validate_mla(self)
        self._validate_lora()
        choice(self, "base_weight_dtype", BASE_WEIGHT_DTYPES)
        positive(self, "base_weight_group")
        self._validate_encoder_decoder()

    def _validate_family_features(self) -> None:
        """The fields the open model families add (biases per group, head_dim, QK-norm, multipliers, soft-caps,
        sliding windows, parallel residual, partial rotary)."""
        choice(self, "qk_norm", QK_NORMS)
        for name in ("attn_qkv_bias", "attn_out_bias", "mlp_bias"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"model.{name}={value!r} must be true, false or null (null follows model.bias)")
        for name in ("parallel_residual",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be true or false")
        if self.attn_head_dim is not None:
            value = self.attn_head_dim
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.attn_head_dim={value!r} must be a positive integer or null "
                                 f"(null = d_model / n_heads)")
        if self.qk_norm != "none" and self.norm != "rmsnorm":
            raise ValueError(f"model.qk_norm={self.qk_norm!r} is an RMSNorm; it needs model.norm=rmsnorm, got "
                             f"{self.norm!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_divisor"):
            value = getattr(self, name)
            if not is_number(value) or not value > 0:
                raise ValueError(f"model.{name}={value!r} must be a number > 0 (1 = none)")
        if not is_number(self.rope_theta) or not self.rope_theta > 0:
            raise ValueError(f"model.rope_theta={self.rope_theta!r} must be a number > 0 (RoPE's base: the angle of "
                             "pair i advances by theta^(-2i/head_dim) per position)")
        if self.attn_score_scale is not None and (not is_number(self.attn_score_scale)
                                                  or not self.attn_score_scale > 0):
            raise ValueError(f"model.attn_score_scale={self.attn_score_scale!r} must be a number > 0 or null")
        for name in ("norm_weight_offset", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ValueError(f"model.{name}={value!r} must be a number >= 0 (0 = none)")
        for name in ("sliding_window", "sliding_window_pattern"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model.{name}={value!r} must be an integer >= 0 (0 = none / every layer)")
        if self.sliding_window and not self.causal:
            raise ValueError(f"model.sliding_window={self.sliding_window} needs a causal model (model.causal=true)")
        if self.rope_local_theta is not None and (self.pos_embedding != "rope" or not self.sliding_window
                                                  or not is_number(self.rope_local_theta)
                                                  or not self.rope_local_theta > 0):
            raise ValueError(f"model.rope_local_theta={self.rope_local_theta!r} is the RoPE base of sliding layers: "
                             "a number > 0, with model.pos_embedding=rope and model.sliding_window > 0")
        if not is_number(self.rotary_fraction) or not 0 < self.rotary_fraction <= 1:
            raise ValueError(f"model.rotary_fraction={self.rotary_fraction!r} must be in (0, 1]")
        if self.rotary_fraction != 1.0 and (self.pos_embedding != "rope" or self.rotary_dim % 2
                                            or self.rotary_dim < 2):
            raise ValueError(f"model.rotary_fraction={self.rotary_fraction} rotates {self.rotary_dim} of "
                             f"head_dim={self.head_dim} dims: it needs model.pos_embedding=rope and an even "
                             "count >= 2")
        if self.parallel_residual and self.norm_placement != "pre":
            raise ValueError(f"model.parallel_residual=true reads both branches off the block input: it needs "
                             f"model.norm_placement=pre, got {self.norm_placement!r}")
        if self.encoder_decoder and self.norm_placement in ("post_branch", "sandwich"):
            raise ValueError(f"model.norm_placement={self.norm_placement!r} is for one stack, not with "
                             f"model.n_decoder_layers={self.n_decoder_layers}")

    def _validate_rope_scaling(self) -> None:
        choice(self, "rope_scaling", ROPE_SCALINGS)
        if self.rope_scaling == "none":
            return
        if self.pos_embedding != "rope":
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} needs model.pos_embedding=rope, "
                             f"got {self.pos_embedding!r}")
        if not is_number(self.rope_scaling_factor) or self.rope_scaling_factor < 1.0:
            raise ValueError(f"model.rope_scaling_factor={self.rope_scaling_factor!r} must be a number >= 1 "
                             f"(with model.rope_scaling={self.rope_scaling!r})")
        if self.rope_scaling not in ("llama3", "yarn"):
            return
        if self.rope_scaling == "yarn":
            positive(self, "rope_original_max_seq_len")
            validate_yarn(self)
            return
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        if not is_number(low) or not is_number(high) or not 0 < low < high:
            raise ValueError(f"model.rope_low_freq_factor={low!r} and model.rope_high_freq_factor={high!r} must be "
                             "numbers with 0 < low < high (Llama 3.1: 1 and 4)")
        positive(self, "rope_original_max_seq_len")

    def _validate_encoder_decoder(self) -> None:
        value = self.n_decoder_layers
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.n_decoder_layers={value!r} must be an integer >= 0 (0 = one stack)")
        if not self.encoder_decoder:
            if self.pos_embedding == "relative":
                raise ValueError("model.pos_embedding=relative (T5's bias) is for encoder-decoder models: set "
                                 "model.n_decoder_layers > 0, or use learned, sinusoidal or rope")
            return
        # one stack's features that an encoder-decoder does not have
        refused = {"causal": (self.causal is not True, "the encoder is bidirectional and the decoder causal; "
                              "data.objective picks the objective"),
                   "n_token_types": (self.n_token_types != 0, "no segment embeddings"),
                   "pooler": (self.pooler, "no pooler"), "mlm_head": (self.mlm_head, "no masked-LM head"),
                   "nsp_head": (self.nsp_head, "no next-sentence head"),
                   "n_experts": (self.n_experts != 0, "mixture-of-experts layers are for one stack"),
                   "pos_embedding": (self.pos_embedding == "rope", "rope is not mapped onto cross-attention; use "
                                     "relative, sinusoidal or learned")}
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"model.{name}={getattr(self, name)!r} with model.n_decoder_layers="
                                 f"{self.n_decoder_layers}: {why}")
        if not 0 <= self.decoder_start_id < self.vocab_size:
            raise ValueError(f"model.decoder_start_id={self.decoder_start_id} is not a token id of "
                             f"model.vocab_size={self.vocab_size}")
        if self.pos_embedding == "relative":
            positive(self, "rel_buckets", "rel_max_distance")
            if self.rel_buckets < 4 or self.rel_buckets % 2:
                raise ValueError(f"model.rel_buckets={self.rel_buckets} must be even and >= 4 (the encoder splits "
                                 "them between the two directions, each half exact then logarithmic)")
            if self.rel_max_distance <= self.rel_buckets // 2:
                raise ValueError(f"model.rel_max_distance={self.rel_max_distance} must exceed rel_buckets/2 = "
                                 f"{self.rel_buckets // 2} (the distances the decoder counts exactly)")

    def _validate_moe(self) -> None:
        validate_moe(self)

    def _validate_lora(self) -> None:
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise ValueError(f"model.lora_rank={self.lora_rank!r} must be an integer >= 0 (0 = no adapters)")
        if not self.lora_rank:
            return
        if self.lora_alpha <= 0:
            raise ValueError(f"model.lora_alpha={self.lora_alpha} must be > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"model.lora_dropout={self.lora_dropout} must be in [0, 1)")
        lora_target_leaves(self)  # ValueError naming unknown targets

    @property
    def lora_scaling(self) -> float:
        """alpha / r: the factor of the low-rank update (Hu et al. 2021, section 4.1)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0
