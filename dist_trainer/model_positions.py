"""Position information for the one model: rotary (RoPE), fixed sinusoidal and T5's relative bias (pure torch).

Learned absolute positions are ``nn.Embedding`` tables of ``model.py`` itself; what is computed lives here:

- RoPE (Su et al. 2021): cos/sin tables computed as transformers computes them, applied to q and k;
- sinusoidal positions (Vaswani et al. 2017, section 3.5), added to the embeddings, no parameters;
- packed documents (docs/data.md): each token's position within its document, and which keys share it;
- T5's relative position bias (Raffel et al. 2020, section 2.1): a learned scalar per head and bucket of the
  key-query distance, added to the attention scores; buckets exact for short distances, logarithmic up to
  ``model.rel_max_distance``; bidirectional in an encoder (half the buckets per direction), causal in a decoder.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dist_trainer.config import ModelConfig
from dist_trainer.facts.mla_shape import yarn_attention_factor


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """The rotary_dim/2 inverse frequencies theta^(-2i/d) (Su et al. 2021; d = ``cfg.rotary_dim``, the head_dim
    unless partial rotary), scaled as ``cfg.rope_scaling`` asks. ``local``: the sliding layers' table, base
    ``cfg.rope_local_theta`` and never scaled (Gemma 3's rope_local_base_freq).

    Computed in fp32 with Hugging Face's operations in its order (transformers' modeling_rope_utils: the default,
    ``_compute_linear_scaling_rope_parameters`` and ``_compute_llama3_parameters``), so the tables equal
    transformers' bit for bit (tests/test_model_hf_maths.py); Meta's reference (``precompute_freqs_cis``) also
    computes them in fp32. A float64 table differs from them by the fp32 rounding of the angle: cos and sin up
    to 2.8e-4 apart over 4096 positions at head_dim 128, theta 5e5 (5e-7 over 16).
    """
    d = cfg.rotary_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if local:
        return inv_freq
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
    if cfg.rope_scaling == "yarn":
        return yarn_inv_freq(cfg, inv_freq, d, theta)
    return inv_freq


def yarn_inv_freq(cfg: ModelConfig, inv_freq: torch.Tensor, d: int, theta: float) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, section 3.2; transformers' ``_compute_yarn_parameters``, its operations
    in its order): dims rotating fewer than beta_slow times over the pretraining length are interpolated (divided by
    factor), those above beta_fast kept, a linear ramp between (the correction range truncated to whole dims)."""
    factor, old_len = cfg.rope_scaling_factor, cfg.rope_original_max_seq_len

    def correction_dim(rotations: float) -> float:
        return (d * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(cfg.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_yarn_beta_slow)), d - 1)
    pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high)
                                                                          - low), 0, 1)
    keep = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rope_cache(cfg: ModelConfig, seq_len: int | None = None, local: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq_len or max_seq_len, rotary_dim/2) for rotary embeddings, fp32 as transformers computes
    them (``rope_inv_freq``): angle = float(position) * inv_freq, rounded to fp32, then its cos and sin (times
    YaRN's attention factor under yarn)."""
    positions = torch.arange(cfg.max_seq_len if seq_len is None else seq_len).float()
    angles = positions[:, None] * rope_inv_freq(cfg, local)
    if cfg.rope_scaling == "yarn" and not local:  # YaRN's temperature on the rotated dims (mla_shape.py)
        factor = yarn_attention_factor(cfg)
        return angles.cos() * factor, angles.sin() * factor
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (B, H, T, D) by the position's angle; in fp32. Tables narrower than
    D/2 (partial rotary, GPT-NeoX) rotate the first 2 * width dims of each head and pass the rest unchanged."""
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
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

def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids, nondecreasing along T -> (B, T) positions restarting at 0 where each segment starts
    (Megatron's ``--reset-position-ids``). Always within [0, T), whatever the ids (a pipeline stage's shape inference
    runs on uninitialised ones)."""
    T = documents.shape[-1]
    index = torch.arange(T, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def same_document(query_documents: torch.Tensor, key_documents: torch.Tensor) -> torch.Tensor:
    """(B, Tq) and (B, Tk) segment ids -> (B, Tq, Tk) bool: True where the query and the key share a segment."""
    return query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2)


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of each (key - query) distance (transformers' ``T5Attention._relative_position_bucket``, written
    with the same operations in the same order, so the buckets agree bit for bit).

    Bidirectional: half the buckets for keys after the query, half for those before. Per direction, distances below
    ``max_exact`` = half its buckets get one bucket each; larger ones share buckets spaced logarithmically up to
    ``max_distance``, beyond which everything falls in the last bucket. Causal: only keys before the query count
    (later keys are masked anyway).
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = torch.abs(relative_position)
    else:
        distance = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Embedding):
    """A stack's relative-position table: ``weight`` (buckets, heads), looked up by bucket, one bias per head.

    An ``nn.Embedding`` (T5's ``relative_attention_bias``), so it is initialised and named like the other tables.
    Heads are read off the table's width, so a TP rank holding a slice of the heads (its columns) runs unchanged.
    """

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, bidirectional: bool) -> None:
        super().__init__(num_buckets, n_heads)
        self.max_distance = max_distance
        self.bidirectional = bidirectional

    def forward(self, q_len: int, k_len: int, offset: int = 0) -> torch.Tensor:  # type: ignore[override]
        """(1, heads, q_len, k_len) bias of queries at positions offset.. against keys at 0..k_len-1."""
        device = self.weight.device
        query = torch.arange(q_len, dtype=torch.long, device=device)[:, None] + offset
        key = torch.arange(k_len, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(key - query, bidirectional=self.bidirectional,
                                           num_buckets=self.num_embeddings, max_distance=self.max_distance)
        # contiguous: a pipeline stage sends it on (p2p buffers are dense)
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0).contiguous()  # (1, H, q, k)

    def extra_repr(self) -> str:
        return (f"buckets={self.num_embeddings}, heads={self.embedding_dim}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")
