"""Phi-3 (``Phi3ForCausalLM``): Llama without biases, with q, k and v fused in ``qkv_proj`` ([q; k; v] rows) and
gate and up in ``gate_up_proj`` ([gate; up]), partial rotary (``partial_rotary_factor``), a sliding window on every
layer when ``sliding_window`` is set, and one dropout rate.

Each of our q, k, v, gate and up reads its block of rows (``Recipe.offset``), so a TP rank reads only its own rows of
each block. RoPE: default only (transformers' Phi3Config accepts default and longrope; longrope is refused by name).
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import head_dim, one_dropout, refuse
from dist_trainer.families.decoder import family_misses, rotary_fraction, window_fields
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "phi3"
FIXED = {"pos_embedding": "rope", "norm": "rmsnorm", "norm_placement": "pre", "activation": "swiglu", "bias": False,
         "n_experts": 0}
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attention_dropout")


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    # the attention and MLP of Phi-3 have no biases whatever attention_bias / mlp_bias say
    keys = {k: v for k, v in hf.items() if k not in ("attention_bias", "mlp_bias", *DROPOUTS)}
    out = llama.fields(keys, where)
    if out.get("rope_scaling", "none") != "none":
        raise refuse(where, "rope_scaling", hf.get("rope_scaling") or hf.get("rope_parameters"),
                     "Phi-3's RoPE here is the default one")
    window = window_fields(where, hf.get("sliding_window"), None, out["n_layers"])
    return {**out, **rotary_fraction(hf), **window, "dropout": one_dropout(hf, where, DROPOUTS)}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    hd, ff = head_dim(m), m.get("d_ff") or 4 * m["d_model"]
    q, kv = m["n_heads"] * hd, (m.get("n_kv_heads") or m["n_heads"]) * hd
    rope = int(hd * m.get("rotary_fraction", 1.0))
    rope_dims = 0 if rope == hd else rope
    p = llama.prefix_of(tensor_names)
    out = {"tok_emb.weight": Recipe(f"{p}embed_tokens.weight"), "final_norm.weight": Recipe(f"{p}norm.weight")}
    for i in range(m["n_layers"]):
        h, o = f"{p}layers.{i}.", f"layers.{i}."
        qkv = f"{h}self_attn.qkv_proj.weight"
        out[f"{o}attn.q_proj.weight"] = Recipe(qkv, offset=0, rows=q, rope_head_dim=hd, rope_dims=rope_dims)
        out[f"{o}attn.k_proj.weight"] = Recipe(qkv, offset=q, rows=kv, rope_head_dim=hd, rope_dims=rope_dims)
        out[f"{o}attn.v_proj.weight"] = Recipe(qkv, offset=q + kv, rows=kv)
        out[f"{o}attn.o_proj.weight"] = Recipe(f"{h}self_attn.o_proj.weight")
        out[f"{o}mlp.gate_proj.weight"] = Recipe(f"{h}mlp.gate_up_proj.weight", offset=0, rows=ff)
        out[f"{o}mlp.up_proj.weight"] = Recipe(f"{h}mlp.gate_up_proj.weight", offset=ff, rows=ff)
        out[f"{o}mlp.down_proj.weight"] = Recipe(f"{h}mlp.down_proj.weight")
        out[f"{o}attn_norm.weight"] = Recipe(f"{h}input_layernorm.weight")
        out[f"{o}mlp_norm.weight"] = Recipe(f"{h}post_attention_layernorm.weight")
    if not m["tie_embeddings"]:
        out["head.weight"] = Recipe("lm_head.weight")
    return out


def misses(m: dict[str, Any]) -> list[str]:
    return family_misses(m, MODEL_TYPE, FIXED, {(False, False, False)}, {"rotary_fraction", "sliding_window"},
                         rope_scalings=("none",), window_patterns="all")


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    keys = {k: v for k, v in llama.hf_keys(m).items() if k not in ("attention_bias", "mlp_bias", "rope_scaling")}
    # pad_token_id: Phi3Config's default (32000) is outside a smaller vocabulary; the tokenizer's, if any, is added
    return {**keys, "partial_rotary_factor": m.get("rotary_fraction", 1.0), "pad_token_id": None,
            "sliding_window": m.get("sliding_window") or None, **{k: m.get("dropout", 0.0) for k in DROPOUTS}}


# phi-3-mini's maths (full rotary, a window on every layer) are Mistral's too: its hf_family (set by a Phi-3 folder
# and by the preset) makes an export write it back as Phi-3
FAMILY = Family(MODEL_TYPE, "Phi3ForCausalLM", to_model, read_plan, misses, to_hf, presets=("phi-3-mini",))
