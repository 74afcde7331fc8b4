"""Multi-head latent attention's shape arithmetic (DeepSeek-V2/V3; torch-free; its field checks: config_mla.py).

MLA (DeepSeek-AI 2024, arXiv 2405.04434, section 2.1) compresses keys and values into one latent per token:

    c_kv, k_pe = split(kv_a_proj(x), [kv_lora_rank, qk_rope_head_dim])      # k_pe: one rotated key every head shares
    k_nope, v  = split(kv_b_proj(kv_a_norm(c_kv)) per head, [qk_nope_head_dim, v_head_dim])
    q          = q_b_proj(q_a_norm(q_a_proj(x))) per head = [q_nope, q_pe]   # q_proj(x) when q_lora_rank is 0
    scores     = [q_nope, rope(q_pe)] . [k_nope, rope(k_pe)] * scale          # qk_head_dim^-0.5 (x yarn mscale^2)
    out        = o_proj(softmax(scores) v)                                   # n_heads * v_head_dim -> d_model

Under TP (``parallel/tp/apply.py``) the heads split: q_b_proj and kv_b_proj column-parallel by whole heads, o_proj
row-parallel; the down projections (q_a_proj, kv_a_proj) and their norms are replicated, each rank's gradient of
them a partial sum over its heads (summed over TP), as the ``f`` before them sums the input's.
"""

from __future__ import annotations

import math
from typing import Protocol

# a latent-attention layer's parameterised leaves under ``attn`` (model_mla.py), module order
MLA_MODULES = ("q_proj", "q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj")
MLA_REPLICATED = ("q_a_proj", "q_a_norm", "kv_a_proj", "kv_a_norm")  # whole on every TP rank


class MLAShape(Protocol):
    d_model: int
    n_heads: int
    n_kv_heads: int | None
    kv_lora_rank: int
    q_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_scaling: str
    rope_scaling_factor: float
    rope_original_max_seq_len: int
    rope_yarn_beta_fast: float
    rope_yarn_beta_slow: float
    rope_yarn_mscale: float
    rope_yarn_mscale_all_dim: float
    pos_embedding: str
    qk_norm: str
    n_decoder_layers: int
    causal: bool
    lora_rank: int
    base_weight_dtype: str

    def linear_bias(self, group: str) -> bool: ...


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1), as transformers'
    ``get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(cfg: MLAShape) -> float:
    """The factor on yarn's cos and sin tables (transformers' ``_compute_yarn_parameters``): mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set (DeepSeek-V3: 1), else mscale(factor); 1 without yarn."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    factor, m, m_all = cfg.rope_scaling_factor, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim
    if m and m_all:
        return yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    return yarn_mscale(factor)


def mla_score_scale(cfg: MLAShape) -> float:
    """Latent attention's multiplier of q.k: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a
    scaled RoPE with mscale_all_dim set (DeepSeek-V3's softmax_scale; transformers' ``yarn_apply_mscale``)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling != "none" and cfg.rope_yarn_mscale_all_dim:
        m = yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim)
        scale = scale * m * m
    return scale


def mla_params(cfg: MLAShape, tp_size: int = 1) -> dict[str, int]:
    """One latent attention's parameters on one TP rank, keyed as ``MLA_MODULES`` (0: not built). The down
    projections carry the q/k/v bias group (transformers' attention_bias), o_proj the out group; q_b and kv_b have
    none (as DeepSeek's)."""
    h, heads = cfg.d_model, cfg.n_heads // tp_size
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    down_bias, out_bias = int(cfg.linear_bias("qkv")), int(cfg.linear_bias("out"))
    q_rank, kv_a = cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return {"q_proj": 0 if q_rank else h * heads * qk,
            "q_a_proj": (h * q_rank + down_bias * q_rank) if q_rank else 0,
            "q_a_norm": q_rank,
            "q_b_proj": q_rank * heads * qk,
            "kv_a_proj": h * kv_a + down_bias * kv_a,
            "kv_a_norm": cfg.kv_lora_rank,
            "kv_b_proj": cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            "o_proj": heads * cfg.v_head_dim * h + out_bias * h}


def mla_replicated_params(cfg: MLAShape, tp_size: int) -> int:
    """Of ``mla_params``, what every TP rank holds whole: the down projections, their norms and o_proj's bias."""
    if tp_size == 1:
        return 0
    own = mla_params(cfg, tp_size)
    return sum(own[k] for k in MLA_REPLICATED) + int(cfg.linear_bias("out")) * cfg.d_model


def mla_matmul_weights(cfg: MLAShape) -> int:
    """Weights one token meets in matmuls in a latent attention (every projection; norms and biases aside)."""
    h, heads = cfg.d_model, cfg.n_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = cfg.q_lora_rank * (h + heads * qk) if cfg.q_lora_rank else h * heads * qk
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim
                                                                                     + cfg.v_head_dim)
    return q + kv + heads * cfg.v_head_dim * h
