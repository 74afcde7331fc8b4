"""What a latent-attention layer (``model_mla.py``) keeps for backward, per token of the micro-batch on one rank.

Checked against the saved-tensor-hook measurement in tests/test_planner_activations.py. Widths per token: the
down projections' outputs and their norms are whole on every TP rank (q_lora_rank, kv_lora_rank + qk_rope_head_dim),
everything per head is this rank's H = n_heads / tp heads. In order:

* q_a_norm and kv_a_norm are RMSNorms in fp32 (input, rsqrt, normalised product); kv_a_norm's input is a view of
  kv_a_proj's whole output in an fp32 model (its k_pe columns included), an fp32 copy of its c_kv columns under
  autocast; q_b_proj and kv_b_proj keep the norms' outputs (activation dtype);
* RoPE multiplies by the (buffer) tables and keeps nothing; q and k are new (H x qk) tensors after the
  concatenation, v a view of kv_b_proj's output;
* SDPA: queries and keys wider than values are no case of PyTorch's CPU flash kernel, which falls back to the math
  kernel there (scaled q, k^T and v, the probabilities); on CUDA the memory-efficient kernel keeps q, k, v (the view:
  kv_b_proj's whole output), the output and an fp32 log-sum-exp;
* o_proj keeps the heads' merged output (a transpose-reshape copy);
* selective recomputation keeps the core's inputs instead: q (q_b_proj's output), kv_b_proj's output (k_nope and v
  are views of it) and k_pe (a view of kv_a_proj's output, already kept by kv_a_norm in an fp32 model).
"""

from __future__ import annotations

from typing import Protocol

from dist_trainer.config import ModelConfig

Saved = tuple[str, float, int]  # (name, elements per token, bytes each): ``activations.SavedTensor``'s fields


class Spec(Protocol):
    """The fields of ``activations.Spec`` read here (that module imports this one)."""

    @property
    def seq_len(self) -> int: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def precision(self) -> str: ...

    @property
    def attention_kernel(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def act(self) -> int: ...

    @property
    def residual(self) -> int: ...


def _rms_norm(name: str, width: int, keep_input: bool = True) -> list[Saved]:
    """An fp32 RMSNorm of ``width`` features (model_blocks.RMSNorm): its fp32 input, rsqrt and normalised product."""
    return [*([(f"{name}.input", width, 4)] if keep_input else []), (f"{name}.rsqrt", 1, 4),
            (f"{name}.normalised", width, 4)]


def mla_input_leaves(cfg: ModelConfig) -> tuple[str, ...]:
    """The linears that read the attention's input: the q projection (q_a_proj, or q_proj) and kv_a_proj."""
    return ("q_a_proj" if cfg.q_lora_rank else "q_proj", "kv_a_proj")


def mla_attention_kernel(cfg: ModelConfig, spec: Spec) -> str:
    """The kernel SDPA runs: CPU's flash kernel needs values as wide as keys (module docstring)."""
    if spec.device == "cpu" and cfg.head_dim != cfg.v_head_dim:
        return "math"
    return spec.attention_kernel


def mla_saved_tensors(cfg: ModelConfig, spec: Spec, selective: bool) -> list[Saved]:
    """A latent attention's tensors between its input (the attention norm's output, counted by the layer) and its
    output projection, o_proj's input included (module docstring)."""
    t, act = spec.tp_size, spec.act
    heads, qk, v = cfg.n_heads / t, cfg.head_dim, cfg.v_head_dim
    kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    fp32 = spec.precision == "fp32"  # else kv_a_proj's output is 16-bit and the norm reads its fp32 copy
    out: list[Saved] = []
    if cfg.q_lora_rank:
        q = cfg.q_lora_rank
        out += [*_rms_norm("attn.q_a_norm", q), ("attn.q_b_proj.input", q, act)]
    if fp32:  # the fp32 norm reads a view of kv_a_proj's whole output
        out.append(("attn.kv_a_proj.output", kv_a, 4))
    out += [*_rms_norm("attn.kv_a_norm", cfg.kv_lora_rank, keep_input=not fp32),
            ("attn.kv_b_proj.input", cfg.kv_lora_rank, act)]
    o_input = ("o_proj.input", heads * v, act)
    if selective:
        out += [("attn.q_proj_out", heads * qk, act),
                ("attn.kv_b_proj.output", heads * (cfg.qk_nope_head_dim + v), act)]
        if not fp32:  # k_pe: a view of kv_a_proj's 16-bit output, which nothing else keeps
            out.append(("attn.kv_a_proj.output", kv_a, act))
        return [*out, o_input]
    if mla_attention_kernel(cfg, spec) == "math":
        inner = 4 if spec.device == "cpu" else act
        return [*out, ("attn.q_scaled", heads * qk, inner), ("attn.k_t", heads * qk, inner),
                ("attn.v", heads * v, inner), ("attn.probs", heads * spec.seq_len, inner),
                o_input]
    return [*out, ("attn.q", heads * qk, act), ("attn.k", heads * qk, act),
            ("attn.kv_b_proj.output", heads * (cfg.qk_nope_head_dim + v), act),
            ("attn.out", heads * v, act), ("attn.logsumexp", heads, 4), o_input]


def mla_weight_sizes(cfg: ModelConfig, tp_size: int) -> dict[str, int]:
    """The latent attention's linears' weights on one TP rank, by leaf (what autocast casts to 16 bits)."""
    h, heads, qk = cfg.d_model, cfg.n_heads // tp_size, cfg.head_dim
    q = cfg.q_lora_rank
    sizes = {"q_a_proj": h * q, "q_b_proj": q * heads * qk} if q else {"q_proj": h * heads * qk}
    return {**sizes, "kv_a_proj": h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            "kv_b_proj": cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            "o_proj": heads * cfg.v_head_dim * h}
