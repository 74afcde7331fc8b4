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
from dist_trainer.facts.finetune import lora_target_leaves
from dist_trainer.model_lora import LoRALinear, init_adapter_
from dist_trainer.model_moe import MoE
from dist_trainer.model_positions import apply_rope, document_positions, same_document
from dist_trainer.model_seq2seq import KVCache

IGNORE_INDEX = -100
def set_attrs(obj: object, **attrs: object) -> None:
    """Tag a module or parameter with plain attributes (``residual_out``, the regimes' ``tp_*`` tags).

    One place for what type checkers cannot see on ``nn.Module``/``nn.Parameter``; readers use ``getattr``.
    """
    for name, value in attrs.items():
        setattr(obj, name, value)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32: x / rms(x) * (offset + weight). Gemma
    stores its weights around 0 and multiplies by (1 + weight) in fp32 (``model.norm_weight_offset``); the weight
    initialises to 1 - offset so that the product starts at 1 either way."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.float()
        return (xf * (self.offset + weight if self.offset else weight)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset}" if self.offset else "")


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the autocast dtype, cast back to the input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            w = None if self.weight is None else self.weight.float()
            b = None if self.bias is None else self.bias.float()
            return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def build_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The model's norm over ``dim`` features (default d_model)."""
    dim = cfg.d_model if dim is None else dim
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, cfg.norm_weight_offset)
    return LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


# the bias group (ModelConfig.linear_bias) of each layer linear
# (latent attention's down projections q_a_proj, kv_a_proj: the q/k/v group, transformers' attention_bias)
BIAS_GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "out", "q_a_proj": "qkv",
               "kv_a_proj": "qkv", "up_proj": "mlp", "gate_proj": "mlp", "down_proj": "mlp"}


def build_linear(cfg: ModelConfig, leaf: str, in_features: int, out_features: int) -> nn.Linear:
    """A layer's linear ``leaf`` (q_proj, ..., down_proj): with a LoRA adapter when it is one of the targets, with
    a bias when its group has one (``cfg.linear_bias``)."""
    bias = cfg.linear_bias(BIAS_GROUPS[leaf]) if leaf in BIAS_GROUPS else cfg.bias
    if leaf in lora_target_leaves(cfg):
        return LoRALinear(in_features, out_features, bias, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                          dropout=cfg.lora_dropout)
    return nn.Linear(in_features, out_features, bias=bias)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft-capping c * tanh(x / c), written as transformers writes it (divide, tanh, multiply)."""
    return torch.tanh(x / cap) * cap


class Sequence(nn.Module):
    """Which part of each sequence this rank holds: all of it, in order, in one process. The declared seam of a
    layout that splits sequences over ranks, which swaps in its split (docs/architecture.md, "Model"): ``shard``
    keeps this rank's tokens of a whole (B, T, ...) tensor, ``rows`` the rows of a per-position table (learned or
    sinusoidal positions, RoPE's cos and sin) for its ``t`` tokens."""

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def rows(self, table: torch.Tensor, t: int) -> torch.Tensor:
        return table[:t]

    def rows_at(self, table: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        """(B, t, ...) rows of a per-position table for this rank's tokens of packed sequences whose positions
        restart at each document (``documents``: (B, T) segment ids of the whole sequences)."""
        return table[self.shard(document_positions(documents))]


class SDPAttention(nn.Module):
    """The attention core after RoPE: the GQA repeat and SDPA over (B, H, T, D) heads, with an optional SDPA mask
    (a position bias, padding: ``model_seq2seq.attention_mask``) and score scale (None: 1/sqrt(head_dim)). A layout
    that splits sequences swaps in an attention over every rank's tokens here (docs/architecture.md, "Model").

    ``window`` > 0 (sliding-window attention): query i sees keys j with i - window < j <= i. ``softcap`` > 0
    (Gemma 2): the scaled scores become c * tanh(s / c) before the mask, which SDPA cannot do, so that case runs
    the explicit softmax (fp32, as transformers' eager attention); everything else stays on SDPA. The queries are
    the last T of the S keys' positions (S > T: generation over cached keys).

    ``documents`` (B, T) (packed sequences, docs/data.md "Document masking"): a query sees only keys of its own
    segment; the block-diagonal mask is an explicit SDPA mask (the CPU kernel then loses its causal fast path and
    computes, and saves, every score: the mask hides the cross-document ones, it does not skip them)."""

    def __init__(self, causal: bool, dropout: float, scale: float | None = None, window: int = 0,
                 softcap: float = 0.0) -> None:
        super().__init__()
        self.causal, self.dropout, self.scale = causal, dropout, scale
        self.window, self.softcap = window, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # GQA: each kv head serves a group of query heads
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        t, s = q.shape[2], k.shape[2]
        dropout = self.dropout if self.training else 0.0
        if documents is not None:  # (B, 1, t, s): same document, and causal / within the window
            same = same_document(documents, documents).unsqueeze(1)
            mask = _and_mask(mask, same & self.visible(t, s, q.device) if self.causal or self.window else same)
        if not self.window and not self.softcap:
            # a causal mask without a mask tensor; one query row against cached keys (generation) sees them all
            causal = self.causal and mask is None and t == s
            if self.causal and mask is None and 1 < t < s:
                mask = self.visible(t, s, q.device)
            # a documents mask already holds causality (the plain path's other masks do too: attention_mask)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout,
                                                  scale=self.scale)
        mask = _and_mask(mask, self.visible(t, s, q.device)) if self.causal or self.window else mask
        if not self.softcap:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale)
        scale = 1.0 / math.sqrt(q.shape[-1]) if self.scale is None else self.scale
        scores = softcap(torch.matmul(q, k.transpose(-2, -1)) * scale, self.softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = F.dropout(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), dropout, self.training)
        return torch.matmul(probs, v)

    def visible(self, t: int, s: int, device: torch.device) -> torch.Tensor:
        """(t, s) bool, True where query i (at position s - t + i) sees key j: causal, and within the window."""
        query = torch.arange(s - t, s, device=device)[:, None]
        key = torch.arange(s, device=device)[None, :]
        seen = key <= query if self.causal else torch.ones(t, s, dtype=torch.bool, device=device)
        return seen & (key > query - self.window) if self.window else seen


def _and_mask(mask: torch.Tensor | None, visible: torch.Tensor) -> torch.Tensor:
    """An SDPA mask (None, bool or additive float) restricted to ``visible`` (bool)."""
    if mask is None:
        return visible
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, float("-inf"))


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads through SDPA; self-attention, or cross-attention when
    ``memory`` (the encoder output) is given: queries from ``x``, keys and values from ``memory``.

    Head counts are read off the projection widths at run time, so a TP rank whose
    q/k/v projections hold a slice of the heads runs unchanged. q is n_heads * head_dim wide (``cfg.q_dim``, which
    o_proj maps back to d_model), k and v kv_heads * head_dim. ``mask``: an SDPA ``attn_mask`` (a position bias,
    padding; ``model_seq2seq.attention_mask``); ``cache``: a ``model_seq2seq.KVCache`` during generation (with RoPE,
    keys are cached rotated, at their positions). ``window``: this layer's sliding window (0: none), handed to the
    ``attend`` seam with the score scale and ``model.attn_softcap``. ``documents``: the (B, T) segment ids of whole
    packed sequences (docs/data.md): RoPE restarts at each segment, and ``attend`` keeps queries in theirs.
    """

    def __init__(self, cfg: ModelConfig, causal: bool | None = None, window: int = 0) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.causal = cfg.causal if causal is None else causal
        self.dropout = cfg.dropout
        # the q.k multiplier; None: SDPA's 1/sqrt(head_dim)
        self.scale = cfg.attn_score_scale if cfg.attn_score_scale is not None else None if cfg.attn_scale else 1.0
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = build_linear(cfg, "q_proj", cfg.d_model, cfg.q_dim)
        self.k_proj = build_linear(cfg, "k_proj", cfg.d_model, kv_dim)
        self.v_proj = build_linear(cfg, "v_proj", cfg.d_model, kv_dim)
        self.o_proj = build_linear(cfg, "o_proj", cfg.q_dim, cfg.d_model)
        set_attrs(self.o_proj, residual_out=True)  # scaled init (GPT-2 paper, section 2.3)
        # QK-norm (after the projections, before RoPE): per head over head_dim (Qwen3, Gemma 3), or over the whole
        # width of q and of k before the head split (OLMo 2)
        self.qk_norm = cfg.qk_norm
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm != "none":
            full = cfg.qk_norm == "full"
            self.q_norm = build_norm(cfg, cfg.q_dim if full else cfg.head_dim)
            self.k_norm = build_norm(cfg, kv_dim if full else cfg.head_dim)
        self.recompute_core = False  # set by Transformer.set_activation_checkpointing("selective")
        # the seams a sequence split fills: the positions of this rank's tokens, the attention over all of them
        self.sequence = Sequence()
        self.attend: nn.Module = SDPAttention(self.causal, cfg.dropout, self.scale, window, cfg.attn_softcap)

    def heads(self, x: torch.Tensor, proj: nn.Module, norm: nn.Module | None) -> torch.Tensor:
        """(B, T, C) -> (B, H, T, D) through ``proj`` and the QK-norm ``norm`` when there is one."""
        B, T, _ = x.shape
        y = proj(x)
        if norm is not None and self.qk_norm == "full":
            y = norm(y)
        y = y.view(B, T, -1, self.head_dim)
        if norm is not None and self.qk_norm == "head":
            y = norm(y)
        return y.transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, *,
                memory: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        T = x.shape[1]
        q = self.heads(x, self.q_proj, self.q_norm)  # (B, Hq, T, D)
        if cache is not None and cache.cross and cache.k is not None and cache.v is not None:
            k, v = cache.k, cache.v  # cross-attention: the encoder output's keys and values, projected once
        else:
            src = x if memory is None else memory
            k = self.heads(src, self.k_proj, self.k_norm)  # (B, Hkv, S, D)
            v = self.heads(src, self.v_proj, None)
            if cache is not None:
                if rope is not None:  # generation: cached keys are kept rotated, at their own positions
                    start = cache.length
                    cos, sin = rope[0][start:start + T], rope[1][start:start + T]
                    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                    rope = None
                k, v = cache.update(k, v)
        if self.recompute_core and torch.is_grad_enabled():
            # Selective recomputation (Korthikanti et al. 2022, section 4.2): keep only the projections'
            # outputs and run the core again in backward (the RNG state is replayed, so dropout matches).
            y = checkpoint(self.core, q, k, v, rope, mask, documents, use_reentrant=False)
        else:
            y = self.core(q, k, v, rope, mask, documents)
        return self.o_proj(y)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None = None,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE, the GQA repeat, SDPA and the head merge: what selective recomputation runs twice.

        Everything here is cheap to recompute against what it saves: rotated q and k, full-width k and v
        after the repeat, and the kernel's own tensors (the s x s probabilities on the math path).
        """
        B, _, T, _ = q.shape
        if rope is not None and documents is not None:  # positions restart per document: (B, 1, T, D/2) tables
            cos, sin = (self.sequence.rows_at(table, documents).unsqueeze(1) for table in rope)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif rope is not None:
            cos, sin = self.sequence.rows(rope[0], T), self.sequence.rows(rope[1], T)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v, mask) if documents is None else self.attend(q, k, v, mask, documents=documents)
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
        return self.down_proj(self.hidden(self.up_proj(x), None if self.gate_proj is None else self.gate_proj(x)))

    def hidden(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The activated inner features of up_proj's and gate_proj's outputs (a MoE layer's grouped experts too)."""
        if gate is None:
            return activate(up, self.activation)
        # swiglu: silu(gate) * up; geglu (T5 v1.1): gelu_tanh(gate) * up
        return (F.silu(gate) if self.activation == "swiglu" else activate(gate, "gelu_tanh")) * up


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
    """One transformer layer; ``moe`` in place of ``mlp`` in a mixture-of-experts layer
    (``cfg.is_moe_layer(layer_id)``). ``causal``: an encoder-decoder's encoder layers are bidirectional whatever
    ``cfg.causal`` says. Norm placements (``model.norm_placement``):

    - pre (GPT-2, Llama): x + f(norm(x));  post (BERT): norm(x + f(x));
    - post_branch (OLMo 2): x + norm(f(x)), ``attn_norm`` / ``mlp_norm`` on the branch output;
    - sandwich (Gemma 2/3): x + post_norm(f(norm(x))), with ``attn_post_norm`` / ``mlp_post_norm``;
    - parallel_residual (GPT-NeoX, pre-norm): x + attn(attn_norm(x)) + mlp(mlp_norm(x)).

    Each branch output is multiplied by ``model.residual_multiplier`` before its add (Granite). A sliding layer
    (``cfg.is_sliding_layer``) attends within ``model.sliding_window`` and reads the local RoPE table the model
    hands it. ``attn``: the attention the model built for it (latent attention, ``model_mla.py``), else the
    ordinary one."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, causal: bool | None = None,
                 attn: nn.Module | None = None) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        self.pre_norm = cfg.norm_placement == "pre"
        self.parallel_residual = cfg.parallel_residual
        self.residual_multiplier = cfg.residual_multiplier
        causal = cfg.causal if causal is None else causal
        self.sliding = causal and cfg.is_sliding_layer(layer_id)
        self.attn_norm = build_norm(cfg)
        self.attn = Attention(cfg, causal, cfg.sliding_window if self.sliding else 0) if attn is None else attn
        if cfg.norm_placement == "sandwich":
            self.attn_post_norm = build_norm(cfg)
        self.mlp_norm = build_norm(cfg)
        if cfg.is_moe_layer(layer_id):
            self.moe = MoE(cfg, layer_id, lambda width: MLP(cfg, width))
        else:
            self.mlp = MLP(cfg)
        if cfg.norm_placement == "sandwich":
            self.mlp_post_norm = build_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def branch(self, y: torch.Tensor) -> torch.Tensor:
        y = self.drop(y)
        return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None, cache: KVCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        # the attention's keywords: documents only when given, so the default call is the one it always was
        seen = {"mask": mask, "cache": cache, **({} if documents is None else {"documents": documents})}
        if self.parallel_residual:  # transformers' order of the sum: mlp + attn + x
            attn = self.branch(self.attn(self.attn_norm(x), rope, **seen))
            return self.branch(ffn(self.mlp_norm(x))) + attn + x
        if self.pre_norm:
            x = x + self.branch(self.attn(self.attn_norm(x), rope, **seen))
            return x + self.branch(ffn(self.mlp_norm(x)))
        if self.placement == "sandwich":
            x = x + self.branch(self.attn_post_norm(self.attn(self.attn_norm(x), rope, **seen)))
            return x + self.branch(self.mlp_post_norm(ffn(self.mlp_norm(x))))
        if self.placement == "post_branch":
            x = x + self.branch(self.attn_norm(self.attn(x, rope, **seen)))
            return x + self.branch(self.mlp_norm(ffn(x)))
        x = self.attn_norm(x + self.branch(self.attn(x, rope, **seen)))
        return self.mlp_norm(x + self.branch(ffn(x)))


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
    too: it draws nothing, so where it sits in the draw order changes no other weight); unit norms (an RMSNorm's
    weight 1 - model.norm_weight_offset, so (offset + weight) is 1); a MoE layer's expert bias zero.
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
    elif isinstance(module, RMSNorm):
        nn.init.constant_(module.weight, 1.0 - module.offset)  # (offset + weight) starts at 1
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        bias = getattr(module, "bias", None)
        if bias is not None:
            nn.init.zeros_(bias)
    elif isinstance(output_bias := getattr(module, "output_bias", None), nn.Parameter):  # a model with mlm_head
        nn.init.zeros_(output_bias)
    elif isinstance(module, MoE):
        module.reset_expert_bias()
