"""Multi-head latent attention (DeepSeek-V2/V3): the attention of a model with ``model.kv_lora_rank`` > 0.

The maths and the TP split are ``mla_shape.py``'s docstring. Module names under ``layers.{i}.attn``: ``q_a_proj``,
``q_a_norm``, ``q_b_proj`` (or ``q_proj`` when model.q_lora_rank is 0), ``kv_a_proj``, ``kv_a_norm``, ``kv_b_proj``,
``o_proj`` (transformers' ``kv_a_proj_with_mqa`` and ``*_layernorm`` renamed to this model's words).

RoPE pairs are adjacent dims (2i, 2i + 1), the layout DeepSeek's checkpoints store (transformers'
``rope_interleave``), so q_pe and k_pe rotate with ``apply_rope`` as they are. The seams are the ordinary
attention's: ``attend`` (SDPA over (B, H, T, D) heads, v narrower than q and k), ``recompute_core`` (selective
recomputation runs RoPE, the key assembly and the attention again in backward), ``sequence`` (which rows of the
RoPE table this rank's tokens read). During generation the per-head keys and values are cached, as the ordinary
attention's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_trainer.config import ModelConfig
from dist_trainer.facts.mla_shape import mla_score_scale
from dist_trainer.model_blocks import RMSNorm, SDPAttention, Sequence, build_linear, set_attrs
from dist_trainer.model_positions import apply_rope
from dist_trainer.model_seq2seq import KVCache


class MLAttention(nn.Module):
    """Causal multi-head latent attention. Head counts are read off q_b/kv_b's widths at run time, so a TP rank
    holding a slice of the heads runs unchanged."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, heads = cfg.d_model, cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.head_dim = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a_proj = build_linear(cfg, "q_a_proj", h, cfg.q_lora_rank)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps for the latent norms
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        self.kv_a_proj = build_linear(cfg, "kv_a_proj", h, self.kv_rank + self.rope)
        self.kv_a_norm = RMSNorm(self.kv_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = build_linear(cfg, "o_proj", heads * self.v_dim, h)
        set_attrs(self.o_proj, residual_out=True)
        self.recompute_core = False  # set by Transformer.set_activation_checkpointing("selective")
        self.sequence = Sequence()
        self.attend: nn.Module = SDPAttention(True, cfg.dropout, mla_score_scale(cfg))

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, H, T, nope + rope)."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        return q.view(B, T, -1, self.nope + self.rope).transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, *,
                memory: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        assert memory is None and rope is not None, "latent attention is causal self-attention with RoPE"
        B, T, _ = x.shape
        q = self.queries(x)
        c_kv, k_pe = self.kv_a_proj(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(c_kv)).view(B, T, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, H, T, nope), (B, H, T, v)
        k_pe = k_pe.unsqueeze(1)  # (B, 1, T, rope): one rotated key part every head shares
        if cache is not None:  # generation: keys cached whole and rotated, at their own positions
            start = cache.length
            q, k = self.rotate(q, k_nope, k_pe, (rope[0][start:start + T], rope[1][start:start + T]))
            k, v = cache.update(k, v.contiguous())
            return self.o_proj(self.merge(self.attend(q, k, v, mask)))
        if self.recompute_core and torch.is_grad_enabled():
            # selective recomputation (Korthikanti et al. 2022, section 4.2), as the ordinary attention's core
            y = checkpoint(self.core, q, k_nope, k_pe, v, rope, mask, use_reentrant=False)
        else:
            y = self.core(q, k_nope, k_pe, v, rope, mask)
        return self.o_proj(y)

    def rotate(self, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q's and k's last qk_rope_head_dim dims; k_pe broadcast to every head: (q, k), (B, H, T, qk)."""
        cos, sin = rope
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat((q_nope, apply_rope(q_pe, cos, sin)), dim=-1)
        k_pe = apply_rope(k_pe, cos, sin).expand(-1, k_nope.shape[1], -1, -1)
        return q, torch.cat((k_nope, k_pe), dim=-1)

    def core(self, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE, the key assembly, the attention and the head merge: what selective recomputation runs twice."""
        T = q.shape[2]
        q, k = self.rotate(q, k_nope, k_pe, (self.sequence.rows(rope[0], T), self.sequence.rows(rope[1], T)))
        return self.merge(self.attend(q, k, v, mask))

    @staticmethod
    def merge(y: torch.Tensor) -> torch.Tensor:
        """(B, H, T, v) -> (B, T, H * v)."""
        B, _, T, _ = y.shape
        return y.transpose(1, 2).reshape(B, T, -1)
