"""The model's building blocks: norms, linears (LoRA where asked), the attention and MLP sub-layers, a
transformer block, the loss, the sequence seam and the initialisation. ``model.py`` assembles them into the
``Transformer`` (docstring there: the module names the regimes refer to)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_trainer.config import ModelConfig
from dist_trainer.finetune import lora_target_leaves
from dist_trainer.model_lora import LoRALinear, init_adapter_
from dist_trainer.model_moe import MoE
from dist_trainer.model_positions import apply_rope
from dist_trainer.model_seq2seq import KVCache

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


def build_linear(cfg: ModelConfig, leaf: str, in_features: int, out_features: int) -> nn.Linear:
    """A layer's linear ``leaf`` (q_proj, ..., down_proj): with a LoRA adapter when it is one of the targets."""
    if leaf in lora_target_leaves(cfg):
        return LoRALinear(in_features, out_features, cfg.bias, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                          dropout=cfg.lora_dropout)
    return nn.Linear(in_features, out_features, bias=cfg.bias)


class Sequence(nn.Module):
    """Which part of each sequence this rank holds: all of it, in order, in one process. The declared seam of a
    layout that splits sequences over ranks, which swaps in its split (docs/architecture.md, "Model"): ``shard``
    keeps this rank's tokens of a whole (B, T, ...) tensor, ``rows`` the rows of a per-position table (learned or
    sinusoidal positions, RoPE's cos and sin) for its ``t`` tokens."""

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def rows(self, table: torch.Tensor, t: int) -> torch.Tensor:
        return table[:t]


class SDPAttention(nn.Module):
    """The attention core after RoPE: the GQA repeat and SDPA over (B, H, T, D) heads, with an optional SDPA mask
    (a position bias, padding: ``model_seq2seq.attention_mask``) and score scale (None: 1/sqrt(head_dim)). A layout
    that splits sequences swaps in an attention over every rank's tokens here (docs/architecture.md, "Model")."""

    def __init__(self, causal: bool, dropout: float, scale: float | None = None) -> None:
        super().__init__()
        self.causal, self.dropout, self.scale = causal, dropout, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # GQA: each kv head serves a group of query heads
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        # a causal mask without a mask tensor; one query row against cached keys (generation) sees them all
        causal = self.causal and mask is None and q.shape[2] == k.shape[2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              dropout_p=self.dropout if self.training else 0.0, scale=self.scale)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads through SDPA; self-attention, or cross-attention when
    ``memory`` (the encoder output) is given: queries from ``x``, keys and values from ``memory``.

    Head counts are read off the projection widths at run time, so a TP rank whose
    q/k/v projections hold a slice of the heads runs unchanged. ``mask``: an SDPA ``attn_mask`` (a position bias,
    padding; ``model_seq2seq.attention_mask``); ``cache``: a ``model_seq2seq.KVCache`` during generation.
    """

    def __init__(self, cfg: ModelConfig, causal: bool | None = None) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.causal = cfg.causal if causal is None else causal
        self.dropout = cfg.dropout
        self.scale = None if cfg.attn_scale else 1.0  # None: SDPA's 1/sqrt(head_dim)
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = build_linear(cfg, "q_proj", cfg.d_model, cfg.d_model)
        self.k_proj = build_linear(cfg, "k_proj", cfg.d_model, kv_dim)
        self.v_proj = build_linear(cfg, "v_proj", cfg.d_model, kv_dim)
        self.o_proj = build_linear(cfg, "o_proj", cfg.d_model, cfg.d_model)
        set_attrs(self.o_proj, residual_out=True)  # scaled init (GPT-2 paper, section 2.3)
        self.recompute_core = False  # set by Transformer.set_activation_checkpointing("selective")
        # the seams a sequence split fills: the positions of this rank's tokens, the attention over all of them
        self.sequence = Sequence()
        self.attend: nn.Module = SDPAttention(self.causal, cfg.dropout, self.scale)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, *,
                memory: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        if cache is not None and cache.cross and cache.k is not None and cache.v is not None:
            k, v = cache.k, cache.v  # cross-attention: the encoder output's keys and values, projected once
        else:
            src = x if memory is None else memory
            k = self.k_proj(src).view(B, src.shape[1], -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
            v = self.v_proj(src).view(B, src.shape[1], -1, self.head_dim).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(k, v)
        if self.recompute_core and torch.is_grad_enabled():
            # Selective recomputation (Korthikanti et al. 2022, section 4.2): keep only the projections'
            # outputs and run the core again in backward (the RNG state is replayed, so dropout matches).
            y = checkpoint(self.core, q, k, v, rope, mask, use_reentrant=False)
        else:
            y = self.core(q, k, v, rope, mask)
        return self.o_proj(y)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE, the GQA repeat, SDPA and the head merge: what selective recomputation runs twice.

        Everything here is cheap to recompute against what it saves: rotated q and k, full-width k and v
        after the repeat, and the kernel's own tensors (the s x s probabilities on the math path).
        """
        B, _, T, _ = q.shape
        if rope is not None:
            cos, sin = self.sequence.rows(rope[0], T), self.sequence.rows(rope[1], T)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v, mask)
        return y.transpose(1, 2).reshape(B, T, -1)  # (B, T, Hq*D)


class MLP(nn.Module):
    """Feed-forward block: up -> activation -> down, gated (SwiGLU or GEGLU, Shazeer 2020) when asked."""

    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        self.activation = cfg.activation
        width = cfg.ffn_dim if width is None else width  # a MoE layer's shared expert is wider
        self.up_proj = build_linear(cfg, "up_proj", cfg.d_model, width)
        self.gate_proj = build_linear(cfg, "gate_proj", cfg.d_model, width) if cfg.gated else None
        self.down_proj = build_linear(cfg, "down_proj", width, cfg.d_model)
        set_attrs(self.down_proj, residual_out=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(x)
        if self.gate_proj is None:
            return self.down_proj(activate(up, self.activation))
        gate = self.gate_proj(x)  # swiglu: silu(gate) * up; geglu (T5 v1.1): gelu_tanh(gate) * up
        return self.down_proj((F.silu(gate) if self.activation == "swiglu" else activate(gate, "gelu_tanh")) * up)


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
    mixture-of-experts layer (``cfg.is_moe_layer(layer_id)``). ``causal``: an encoder-decoder's encoder
    layers are bidirectional whatever ``cfg.causal`` says."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, causal: bool | None = None) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.attn_norm = build_norm(cfg)
        self.attn = Attention(cfg, causal)
        self.mlp_norm = build_norm(cfg)
        if cfg.is_moe_layer(layer_id):
            self.moe = MoE(cfg, layer_id, lambda width: MLP(cfg, width))
        else:
            self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        if self.pre_norm:
            x = x + self.drop(self.attn(self.attn_norm(x), rope, mask=mask))
            return x + self.drop(ffn(self.mlp_norm(x)))
        x = self.attn_norm(x + self.drop(self.attn(x, rope, mask=mask)))
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
        depth = cfg.n_layers + cfg.n_decoder_layers  # residual layers of both stacks of an encoder-decoder
        nn.init.normal_(module.weight, 0.0, cfg.init_std / math.sqrt(2 * depth) if scaled else cfg.init_std)
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
