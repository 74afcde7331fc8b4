"""The encoder-decoder pieces of the one model (``model.n_decoder_layers`` > 0): pure torch, nothing distributed.

Vaswani et al. 2017 (section 3.1): an encoder stack of bidirectional self-attention + MLP layers, and a decoder stack
whose layers add, between causal self-attention and the MLP, cross-attention: queries from the decoder state, keys
and values from the encoder output (the same "memory" for every decoder layer). ``model.py`` builds both stacks from
its own attention, MLP and norm modules; this module holds what only the encoder-decoder has:

- ``DecoderBlock``: self-attention, cross-attention, MLP, each a residual branch with its norm (pre-norm: T5;
  post-norm: the original Transformer's ``LayerNorm(x + Sublayer(x))``);
- T5's relative position bias (``model_positions.RelativePositionBias``): one table per stack, computed once per
  forward and shared by the stack's layers (T5 keeps it in its first layer; here it is the stack's ``rel_emb`` /
  ``dec_rel_emb``);
- ``attention_mask``: the bias, the causal mask and the source's padding as one SDPA mask;
- ``KVCache``: incremental decoding (generation): a self-attention layer appends each step's keys and values, a
  cross-attention layer projects the encoder output once and keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def attention_mask(bias: torch.Tensor | None, key_mask: torch.Tensor | None, *, causal: bool
                   ) -> torch.Tensor | None:
    """One SDPA ``attn_mask`` for a stack's layers, or None (then a causal stack uses SDPA's ``is_causal``).

    ``bias``: (1, H, q, k) position bias (a float mask added to the scores); ``key_mask``: (B, k) bool, False at the
    source's padding; ``causal``: mask keys after the query (folded into the bias when there is one, since SDPA
    takes ``is_causal`` only without a mask). Masked scores are -inf: a query always sees at least one key
    (padding is on the right, every source holds one token).
    """
    if bias is None:
        return None if key_mask is None else key_mask[:, None, None, :]  # bool: True attends
    if causal:
        q, k = bias.shape[-2:]
        bias = bias.masked_fill(torch.ones(q, k, dtype=torch.bool, device=bias.device).triu(k - q + 1), float("-inf"))
    if key_mask is not None:
        bias = bias.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return bias


@dataclass
class KVCache:
    """One attention layer's keys and values during generation, (B, H, T, D) each.

    Self-attention (``cross`` False) appends each step's new keys and values; cross-attention keeps what it
    projected from the encoder output on the first step and never projects it again."""

    cross: bool = False
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None and self.v is not None and not self.cross:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


@dataclass
class LayerCache:
    """A decoder layer's caches: its self-attention's and its cross-attention's."""

    self_attn: KVCache
    cross_attn: KVCache


def new_caches(n_layers: int) -> list[LayerCache]:
    return [LayerCache(KVCache(), KVCache(cross=True)) for _ in range(n_layers)]


class DecoderBlock(nn.Module):
    """One decoder layer: causal self-attention, cross-attention over the encoder output, MLP (Vaswani et al. 2017,
    section 3.1), each with its norm and residual dropout; built by ``model.py`` from its own modules.

    Module names: ``attn_norm``, ``attn.{q,k,v,o}_proj``, ``cross_norm``, ``cross_attn.{q,k,v,o}_proj``,
    ``mlp_norm``, ``mlp.{up,gate,down}_proj``.
    """

    def __init__(self, *, attn_norm: nn.Module, attn: nn.Module, cross_norm: nn.Module, cross_attn: nn.Module,
                 mlp_norm: nn.Module, mlp: nn.Module, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.attn_norm, self.attn = attn_norm, attn
        self.cross_norm, self.cross_attn = cross_norm, cross_attn
        self.mlp_norm, self.mlp = mlp_norm, mlp
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, self_mask: torch.Tensor | None = None,
                cross_mask: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """(B, T, C) decoder state, (B, S, C) encoder output -> (B, T, C)."""
        self_cache = None if cache is None else cache.self_attn
        cross_cache = None if cache is None else cache.cross_attn
        if self.pre_norm:
            x = x + self.drop(self.attn(self.attn_norm(x), None, mask=self_mask, cache=self_cache))
            x = x + self.drop(self.cross_attn(self.cross_norm(x), None, memory=memory, mask=cross_mask,
                                              cache=cross_cache))
            return x + self.drop(self.mlp(self.mlp_norm(x)))
        x = self.attn_norm(x + self.drop(self.attn(x, None, mask=self_mask, cache=self_cache)))
        x = self.cross_norm(x + self.drop(self.cross_attn(x, None, memory=memory, mask=cross_mask,
                                                          cache=cross_cache)))
        return self.mlp_norm(x + self.drop(self.mlp(x)))
