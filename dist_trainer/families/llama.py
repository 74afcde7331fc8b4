"""Llama 2 and 3 (``LlamaForCausalLM``): RoPE, RMSNorm, SwiGLU, grouped k/v heads; the base of the Llama-like
families (``mistral``, ``mixtral`` and others import ``fields``, ``layer_recipes``, ``hf_keys`` and
``llama_misses``).

``attention_bias`` gives q, k, v and o biases (``attn_qkv_bias``, ``attn_out_bias``), ``mlp_bias`` the MLP's;
``head_dim`` may differ from hidden_size / num_attention_heads (``attn_head_dim``). q and k rows are stored in
rotate_half order per head (``recipe.py``), their biases too.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families.base import Family
from dist_trainer.families.common import (
    head_dim,
    linear_bias,
    need,
    prefix,
    refuse,
    require,
    rope_fields,
    rope_hf,
    unmapped,
)
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "llama"
ROPE_SCALINGS = ("none", "linear", "llama3")  # those rope_fields maps and rope_hf writes


def fields(hf: dict[str, Any], where: str, biases: bool = True) -> dict[str, Any]:
    """The ModelConfig fields of a Llama-like config.json (``biases``: whether ``attention_bias``/``mlp_bias`` true
    are mapped; otherwise refused). ``sliding_window`` is left to the caller."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(where, "hidden_act", act, "the gated MLP of this family is SwiGLU (silu)")
    if not biases:
        require(hf, where, "attention_bias", (False,), "this family has no biases")
        require(hf, where, "mlp_bias", (False,), "this family has no biases")
    if float(hf.get("attention_dropout", 0.0) or 0.0) != 0.0:
        raise refuse(where, "attention_dropout", hf["attention_dropout"], "only 0 is mapped for this family")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    out: dict[str, Any] = {
        "vocab_size": int(hf["vocab_size"]), "d_model": d, "n_layers": int(hf["num_hidden_layers"]), "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads), "d_ff": int(hf["intermediate_size"]),
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)), "pos_embedding": "rope",
        **rope_fields(hf, where), "norm": "rmsnorm", "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "norm_placement": "pre", "activation": "swiglu", "bias": False,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "dropout": 0.0, "causal": True,
        "n_token_types": 0, "pooler": False, "n_experts": 0}
    if hf.get("head_dim") is not None and int(hf["head_dim"]) != d // heads:
        out["attn_head_dim"] = int(hf["head_dim"])
    if hf.get("attention_bias"):
        out.update(attn_qkv_bias=True, attn_out_bias=True)
    if hf.get("mlp_bias"):
        out["mlp_bias"] = True
    return out


def refuse_window(hf: dict[str, Any], where: str) -> None:
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise refuse(where, "sliding_window", hf["sliding_window"], "attention here is full causal attention; "
                     "set sliding_window to null only if the model was trained without it")


def layer_recipes(m: dict[str, Any], h: str, o: str, mlp: bool = True) -> dict[str, Recipe]:
    """Recipes of layer ``o`` (``layers.{i}.``) from HF layer ``h`` (``model.layers.{i}.``): attention, norms and
    (``mlp``) the gated MLP, each bias where ModelConfig gives one."""
    hd = head_dim(m)
    out = {}
    for leaf, group, rope in (("q_proj", "qkv", hd), ("k_proj", "qkv", hd), ("v_proj", "qkv", 0),
                              ("o_proj", "out", 0)):
        out[f"{o}attn.{leaf}.weight"] = Recipe(f"{h}self_attn.{leaf}.weight", rope_head_dim=rope)
        if linear_bias(m, group):
            out[f"{o}attn.{leaf}.bias"] = Recipe(f"{h}self_attn.{leaf}.bias", rope_head_dim=rope)
    out[f"{o}attn_norm.weight"] = Recipe(f"{h}input_layernorm.weight")
    out[f"{o}mlp_norm.weight"] = Recipe(f"{h}post_attention_layernorm.weight")
    for leaf in ("gate_proj", "up_proj", "down_proj") if mlp else ():
        out[f"{o}mlp.{leaf}.weight"] = Recipe(f"{h}mlp.{leaf}.weight")
        if linear_bias(m, "mlp"):
            out[f"{o}mlp.{leaf}.bias"] = Recipe(f"{h}mlp.{leaf}.bias")
    return out


def model_recipes(m: dict[str, Any], p: str, mlp: bool = True) -> dict[str, Recipe]:
    """Embedding, every layer (``layer_recipes``), final norm and an untied head, under prefix ``p``."""
    out = {"tok_emb.weight": Recipe(f"{p}embed_tokens.weight"), "final_norm.weight": Recipe(f"{p}norm.weight")}
    for i in range(m["n_layers"]):
        out.update(layer_recipes(m, f"{p}layers.{i}.", f"layers.{i}.", mlp))
    if not m["tie_embeddings"]:
        out["head.weight"] = Recipe("lm_head.weight")
    return out


def prefix_of(tensor_names: set[str]) -> str:
    """``model.`` of ``*ForCausalLM``, or none of a bare ``*Model``."""
    return prefix(tensor_names, "embed_tokens.weight", ("model.", ""))


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    return model_recipes(m, prefix_of(tensor_names))


def llama_misses(m: dict[str, Any], mapped: set[str], family: str, biases: bool = True) -> list[str]:
    """What of ``m`` a Llama-like ``family`` cannot hold: its fixed choices, Llama's one attention_bias for q, k, v
    and o (``biases``; else none at all), RoPE scalings, and every other field off its default not in ``mapped``."""
    out = need(m, pos_embedding="rope", norm="rmsnorm", norm_placement="pre", activation="swiglu", bias=False)
    qkv, o, mlp = linear_bias(m, "qkv"), linear_bias(m, "out"), linear_bias(m, "mlp")
    if not biases and (qkv or o or mlp):
        out.append(f"attn_qkv_bias={qkv}, attn_out_bias={o}, mlp_bias={mlp} ({family} has no biases)")
    elif qkv != o:
        out.append(f"attn_qkv_bias={qkv} with attn_out_bias={o} (attention_bias sets both)")
    if m.get("rope_scaling", "none") not in ROPE_SCALINGS:
        out.append(f"rope_scaling={m.get('rope_scaling')!r} (needs one of {', '.join(ROPE_SCALINGS)})")
    keys = {"attn_qkv_bias", "attn_out_bias", "mlp_bias", "attn_head_dim", "rope_scaling", *mapped}
    return out + unmapped(m, keys, family)


def hf_keys(m: dict[str, Any]) -> dict[str, Any]:
    """The Llama-like config.json keys of ``m``."""
    heads = m["n_heads"]
    return {"hidden_size": m["d_model"], "num_hidden_layers": m["n_layers"], "num_attention_heads": heads,
            "num_key_value_heads": m.get("n_kv_heads") or heads, "head_dim": head_dim(m),
            "intermediate_size": m.get("d_ff") or 4 * m["d_model"], "max_position_embeddings": m["max_seq_len"],
            "rms_norm_eps": m["norm_eps"], "hidden_act": "silu", **rope_hf(m),
            "attention_bias": linear_bias(m, "qkv"), "mlp_bias": linear_bias(m, "mlp"), "attention_dropout": 0.0}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    refuse_window(hf, where)
    return fields(hf, where)


def misses(m: dict[str, Any]) -> list[str]:
    return llama_misses(m, set(), MODEL_TYPE)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    return hf_keys(m)


FAMILY = Family(MODEL_TYPE, "LlamaForCausalLM", to_model, read_plan, misses, to_hf,
                presets=("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b"))
