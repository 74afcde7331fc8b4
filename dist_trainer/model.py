"""The one model definition: GPT-2, Llama and BERT families from one ModelConfig.

Pure torch: nothing here knows how it is parallelised. Regimes rewrite modules by
name (``parallel/tp/apply.py``), split ``layers`` into stages
(``parallel/pipeline/split.py``) or hand the module to DeepSpeed. The loss is a module
(``self.loss``) so that tensor parallelism can swap in a vocab-parallel one.

Module names (the TP plan refers to them):
  tok_emb, pos_emb, type_emb, emb_norm,
  layers.{i}.attn_norm, layers.{i}.attn.{q,k,v,o}_proj,
  layers.{i}.mlp_norm, layers.{i}.mlp.{up,gate,down}_proj,
  final_norm, mlm_transform.{dense,norm} and output_bias (a parameter of the model itself; model.mlm_head),
  head (absent when tied), pooler, loss
A mixture-of-experts layer (``model.n_experts`` > 0, ``model_moe.py``) holds ``layers.{i}.moe.{router,
experts.{e}.*, shared_expert.*}`` in place of ``layers.{i}.mlp``.

With ``model.lora_rank`` > 0 the ``model.lora_targets`` linears are ``model_lora.LoRALinear``s (their
adapters are ``<linear>.lora_A`` / ``.lora_B``) and every base parameter is frozen (``finetune.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_trainer.config import ModelConfig
from dist_trainer.finetune import lora_target_leaves
from dist_trainer.model_lora import LoRALinear, init_adapter_, is_adapter
from dist_trainer.model_moe import MoE, add_aux_losses

IGNORE_INDEX = -100


def set_attrs(obj: object, **attrs: object) -> None:
    """Tag a module or parameter with plain attributes (``residual_out``, the regimes' ``tp_*`` tags).

    One place for what type checkers cannot see on ``nn.Module``/``nn.Parameter``; readers use ``getattr``.
    """
    for name, value in attrs.items():
        setattr(obj, name, value)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the autocast dtype, cast back to the input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            w = None if self.weight is None else self.weight.float()
            b = None if self.bias is None else self.bias.float()
            return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The head_dim/2 inverse frequencies theta^(-2i/d) (Su et al. 2021), scaled as ``cfg.rope_scaling`` asks.

    Computed in fp32 with Hugging Face's operations in its order (transformers' modeling_rope_utils: the default,
    ``_compute_linear_scaling_rope_parameters`` and ``_compute_llama3_parameters``), so the tables equal
    transformers' bit for bit (tests/test_model_hf_maths.py); Meta's reference (``precompute_freqs_cis``) also
    computes them in fp32. A float64 table differs from them by the fp32 rounding of the angle: cos and sin up
    to 2.8e-4 apart over 4096 positions at head_dim 128, theta 5e5 (5e-7 over 16).
    """
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling == "linear":  # position interpolation: positions / factor, applied to the frequencies instead
        return inv_freq / cfg.rope_scaling_factor
    if cfg.rope_scaling == "llama3":
        factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_seq_len
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths (> old_len / low) are divided by factor, short ones (< old_len / high) kept, and the
        # band between is a linear blend in old_len / wavelen
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


def rope_cache(cfg: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq_len or max_seq_len, head_dim/2) for rotary embeddings, fp32 as transformers computes
    them (``rope_inv_freq``): angle = float(position) * inv_freq, rounded to fp32, then its cos and sin."""
    positions = torch.arange(cfg.max_seq_len if seq_len is None else seq_len).float()
    angles = positions[:, None] * rope_inv_freq(cfg)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (B, H, T, D) by the position's angle; in fp32."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, H, T, D/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def sinusoidal_table(seq_len: int, dim: int) -> torch.Tensor:
    """Fixed sine/cosine positions (Vaswani et al. 2017, section 3.5): (seq_len, dim)."""
    pos = torch.arange(seq_len, dtype=torch.float64).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(seq_len, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)
    return table.float()


def build_linear(cfg: ModelConfig, leaf: str, in_features: int, out_features: int) -> nn.Linear:
    """A layer's linear ``leaf`` (q_proj, ..., down_proj): with a LoRA adapter when it is one of the targets."""
    if leaf in lora_target_leaves(cfg):
        return LoRALinear(in_features, out_features, cfg.bias, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                          dropout=cfg.lora_dropout)
    return nn.Linear(in_features, out_features, bias=cfg.bias)


class Sequence(nn.Module):
    """Which part of each sequence this rank holds: all of it, in order, in one process. The declared seam of
    context parallelism, which swaps in its split (``parallel/cp``): ``shard`` keeps this rank's tokens of a whole
    (B, T, ...) tensor, ``rows`` the rows of a per-position table (learned or sinusoidal positions, RoPE's cos and
    sin) for its ``t`` tokens."""

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def rows(self, table: torch.Tensor, t: int) -> torch.Tensor:
        return table[:t]


class SDPAttention(nn.Module):
    """The attention core after RoPE: the GQA repeat and SDPA over (B, H, T, D) heads. Context parallelism swaps
    in ring or all-to-all attention here (``parallel/cp``)."""

    def __init__(self, causal: bool, dropout: float) -> None:
        super().__init__()
        self.causal, self.dropout = causal, dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # GQA: each kv head serves a group of query heads
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                              dropout_p=self.dropout if self.training else 0.0)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads through SDPA.

    Head counts are read off the projection widths at run time, so a TP rank whose
    q/k/v projections hold a slice of the heads runs unchanged.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.causal = cfg.causal
        self.dropout = cfg.dropout
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = build_linear(cfg, "q_proj", cfg.d_model, cfg.d_model)
        self.k_proj = build_linear(cfg, "k_proj", cfg.d_model, kv_dim)
        self.v_proj = build_linear(cfg, "v_proj", cfg.d_model, kv_dim)
        self.o_proj = build_linear(cfg, "o_proj", cfg.d_model, cfg.d_model)
        set_attrs(self.o_proj, residual_out=True)  # scaled init (GPT-2 paper, section 2.3)
        self.recompute_core = False  # set by Transformer.set_activation_checkpointing("selective")
        # the seams context parallelism fills: the positions of this rank's tokens, the attention over all of them
        self.sequence = Sequence()
        self.attend: nn.Module = SDPAttention(cfg.causal, cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.recompute_core and torch.is_grad_enabled():
            # Selective recomputation (Korthikanti et al. 2022, section 4.2): keep only the projections'
            # outputs and run the core again in backward (the RNG state is replayed, so dropout matches).
            y = checkpoint(self.core, q, k, v, rope, use_reentrant=False)
        else:
            y = self.core(q, k, v, rope)
        return self.o_proj(y)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """RoPE, the GQA repeat, SDPA and the head merge: what selective recomputation runs twice.

        Everything here is cheap to recompute against what it saves: rotated q and k, full-width k and v
        after the repeat, and the kernel's own tensors (the s x s probabilities on the math path).
        """
        B, _, T, _ = q.shape
        if rope is not None:
            cos, sin = self.sequence.rows(rope[0], T), self.sequence.rows(rope[1], T)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v)
        return y.transpose(1, 2).reshape(B, T, -1)  # (B, T, Hq*D)


class MLP(nn.Module):
    """Feed-forward block: up -> activation -> down, gated (SwiGLU, Shazeer 2020) when asked."""

    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        self.activation = cfg.activation
        width = cfg.ffn_dim if width is None else width  # a MoE layer's shared expert is wider
        self.up_proj = build_linear(cfg, "up_proj", cfg.d_model, width)
        self.gate_proj = build_linear(cfg, "gate_proj", cfg.d_model, width) if cfg.activation == "swiglu" else None
        self.down_proj = build_linear(cfg, "down_proj", width, cfg.d_model)
        set_attrs(self.down_proj, residual_out=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(x)
        h = F.silu(self.gate_proj(x)) * up if self.gate_proj is not None else activate(up, self.activation)
        return self.down_proj(h)


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """A non-gated activation: relu, exact gelu (BERT) or its tanh approximation (GPT-2's gelu_new)."""
    if activation == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


class MLMTransform(nn.Module):
    """BERT's prediction-head transform (BertPredictionHeadTransform): norm(activation(dense(x))), before the
    output projection (Devlin et al. 2019; the masked-LM head of the released checkpoints)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.activation = cfg.activation
        self.dense = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.norm = build_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(activate(self.dense(x), self.activation))


class Block(nn.Module):
    """One transformer layer; pre-norm (GPT-2/Llama) or post-norm (BERT); ``moe`` in place of ``mlp`` in a
    mixture-of-experts layer (``cfg.is_moe_layer(layer_id)``)."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.attn_norm = build_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = build_norm(cfg)
        if cfg.is_moe_layer(layer_id):
            self.moe = MoE(cfg, layer_id, lambda width: MLP(cfg, width))
        else:
            self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        if self.pre_norm:
            x = x + self.drop(self.attn(self.attn_norm(x), rope))
            return x + self.drop(ffn(self.mlp_norm(x)))
        x = self.attn_norm(x + self.drop(self.attn(x, rope)))
        return self.mlp_norm(x + self.drop(ffn(x)))


class LMLoss(nn.Module):
    """Token cross-entropy in fp32, mean over targets that are not IGNORE_INDEX."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX
        )


@torch.no_grad()
def init_weights_(module: nn.Module, cfg: ModelConfig) -> None:
    """The initial values of one module's own parameters, drawn from the global RNG.

    Normal(0, init_std) for linear and embedding weights, with residual output projections
    at init_std / sqrt(2 * n_layers) (GPT-2 paper, section 2.3); zero biases (the model's own ``output_bias``
    too: it draws nothing, so where it sits in the draw order changes no other weight); unit norms.
    A LoRA adapter draws from its own generator (``model_lora.init_adapter_``), never from the global one.
    Other modules are left alone.
    """
    if isinstance(module, nn.Linear):
        scaled = cfg.scaled_residual_init and getattr(module, "residual_out", False)
        nn.init.normal_(module.weight, 0.0, cfg.init_std / math.sqrt(2 * cfg.n_layers) if scaled else cfg.init_std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, LoRALinear):
            init_adapter_(module, torch.initial_seed())  # the seed the caller set: see model_lora's docstring
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, cfg.init_std)
    elif isinstance(module, (nn.LayerNorm, RMSNorm)):
        nn.init.ones_(module.weight)
        bias = getattr(module, "bias", None)
        if bias is not None:
            nn.init.zeros_(bias)
    elif isinstance(output_bias := getattr(module, "output_bias", None), nn.Parameter):  # a model with mlm_head
        nn.init.zeros_(output_bias)


class Transformer(nn.Module):
    """Decoder (causal LM) or encoder (masked LM) transformer, configured by ModelConfig."""

    # buffers, registered by _init_buffers for the position embedding in use
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    pos_table: torch.Tensor
    output_bias: nn.Parameter | None  # registered in __init__ (None without model.mlm_head)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos_embedding == "learned" else None
        self.type_emb = nn.Embedding(cfg.n_token_types, cfg.d_model) if cfg.n_token_types else None
        post = cfg.norm_placement == "post"
        self.emb_norm = build_norm(cfg) if post else None  # BERT normalises the embedding sum
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = None if post else build_norm(cfg)  # post-norm layers end normalised
        self.mlm_transform = MLMTransform(cfg) if cfg.mlm_head else None
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # BERT's decoder bias (cls.predictions.bias): on the model, beside a head that may be the tied embedding
        self.register_parameter("output_bias", nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.mlm_head else None)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias) if cfg.pooler else None
        self.loss: nn.Module = LMLoss()
        # Declared seams (identities in one process) where tensor parallelism swaps in its collectives
        # (parallel/tp/apply.py), so what runs is read here: the head's input enters the TP region (f, or SP's
        # all-gather), generation gathers the vocabulary shards of the logits, the pooler gathers SP's shards.
        self.sequence = Sequence()  # context parallelism's split of the tokens (embed)
        self.head_input: nn.Module = nn.Identity()
        self.full_logits: nn.Module = nn.Identity()
        self.pool_input: nn.Module = nn.Identity()
        self.checkpointed: frozenset[int] = frozenset()
        for name, module in self.named_modules():
            if isinstance(module, LoRALinear):
                module.lora_key = name  # the adapter's generator is seeded by its name (model_lora.init_adapter_)
        for name, p in self.named_parameters():
            if cfg.lora_rank and not is_adapter(name):
                p.requires_grad_(False)  # LoRA trains the adapters only (Hu et al. 2021, section 4.1)
        self._init_buffers()
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def _init_buffers(self) -> None:
        cfg = self.cfg
        if cfg.pos_embedding == "rope":
            cos, sin = rope_cache(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        elif cfg.pos_embedding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.max_seq_len, cfg.d_model), persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every module's ``init_weights_`` in module order, then the position tables.

        Parameters are drawn in module order from the global RNG, so the same seed gives
        the same model in every regime (TP shards are cut from this full draw; pipeline
        stages and ZeRO-3 replay the same per-module draws).
        """
        for module in self.modules():
            init_weights_(module, self.cfg)
        if self.cfg.pos_embedding in ("rope", "sinusoidal"):
            self._init_buffers()  # recompute after to_empty() left them uninitialised

    def set_activation_checkpointing(self, mode: str, every: int = 1, first_layer: int = 0) -> None:
        """none | selective (every layer's attention core) | every_k (layers whose global index % every == 0) |
        full. ``first_layer``: the global index of ``layers[0]`` (a pipeline stage's), which ``run_layers`` is given
        too, so every_k recomputes the same layers as the single model whatever the stage boundaries."""
        ids = range(first_layer, first_layer + len(self.layers))
        for module in self.modules():
            if isinstance(module, Attention):
                module.recompute_core = mode == "selective"
        if mode in ("none", "selective"):
            self.checkpointed = frozenset()
        elif mode == "full":
            self.checkpointed = frozenset(ids)
        elif mode == "every_k":
            self.checkpointed = frozenset(i for i in ids if i % every == 0)
        else:
            raise ValueError(f"activation checkpointing mode {mode!r} is not none, selective, every_k or full")

    def embed(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) input of the first layer (under context parallelism: of this rank's
        tokens, ``sequence.shard``, at their global positions)."""
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise RuntimeError(f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        tokens = self.sequence.shard(tokens)
        T = tokens.shape[1]
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.sequence.rows(self.pos_emb.weight, T)
        elif self.cfg.pos_embedding == "sinusoidal":
            x = x + self.sequence.rows(self.pos_table, T).to(x.dtype)
        if self.type_emb is not None:
            types = torch.zeros_like(tokens) if token_types is None else self.sequence.shard(token_types)
            x = x + self.type_emb(types)
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        return self.emb_drop(x)

    def rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.rope_cos, self.rope_sin) if self.cfg.pos_embedding == "rope" else None

    def run_layers(self, x: torch.Tensor, first_layer: int = 0) -> torch.Tensor:
        rope = self.rope()
        for i, layer in enumerate(self.layers, start=first_layer):
            if i in self.checkpointed and torch.is_grad_enabled():
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope)
        return x

    def output_weight(self) -> torch.Tensor:
        return self.tok_emb.weight if self.head is None else self.head.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) last hidden state -> (B, T, V) logits (final norm, the MLM transform, then the head; under TP
        this rank's vocabulary shard, which ``loss`` consumes)."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.mlm_transform is not None:
            x = self.mlm_transform(x)
        return F.linear(self.head_input(x), self.output_weight(), self.output_bias)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT pooler: tanh(dense(first token)). Not part of the MLM loss."""
        if self.pooler is None:
            raise RuntimeError("this model has no pooler (model.pooler=false)")
        return torch.tanh(self.pooler(self.pool_input(hidden)[:, 0]))

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) when targets is None, else the scalar mean loss (in training, plus the MoE layers'
        router losses)."""
        logits = self.logits(self.run_layers(self.embed(tokens, token_types)))
        return self.full_logits(logits) if targets is None else add_aux_losses(self, self.loss(logits, targets))


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied weight counts once); a ZeRO-3 partition counts its full size (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in {id(p): p for p in model.parameters()}.values())


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Transformer:
    """The model, initialised on CPU from ``seed`` (so every regime draws the same weights)."""
    if seed is not None:
        torch.manual_seed(seed)
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return Transformer(cfg)
    return Transformer(cfg).to(device)
