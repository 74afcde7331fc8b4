"""StarCoder2 (``Starcoder2ForCausalLM``): RoPE, grouped k/v heads, LayerNorms with biases, a plain (ungated)
``c_fc`` / ``c_proj`` MLP, biases on every linear or none (``use_bias``), a sliding window on every layer when
``sliding_window`` is set, one dropout rate and a tied head.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import head_dim, linear_bias, one_dropout, refuse, rope_fields, rope_hf
from dist_trainer.families.decoder import family_misses, window_fields
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "starcoder2"
ACT = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
ACT_HF = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "relu": "relu"}
DROPOUTS = ("residual_dropout", "embedding_dropout", "attention_dropout")


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACT:
        raise refuse(where, "hidden_act", act, f"activations: {', '.join(ACT)}")
    d, heads, n = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    bias = bool(hf.get("use_bias", True))
    out = {"vocab_size": int(hf["vocab_size"]), "d_model": d, "n_layers": n, "n_heads": heads,
           "n_kv_heads": int(hf.get("num_key_value_heads") or heads), "d_ff": int(hf["intermediate_size"]),
           "max_seq_len": int(hf.get("max_position_embeddings", 4096)), "pos_embedding": "rope",
           **rope_fields(hf, where), "norm": "layernorm", "norm_eps": float(hf.get("norm_epsilon", 1e-5)),
           "norm_placement": "pre", "activation": ACT[act], "bias": True, "attn_qkv_bias": bias,
           "attn_out_bias": bias, "mlp_bias": bias, "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
           "dropout": one_dropout(hf, where, DROPOUTS), "causal": True, "n_token_types": 0, "pooler": False}
    if hf.get("head_dim") is not None and int(hf["head_dim"]) != d // heads:
        out["attn_head_dim"] = int(hf["head_dim"])
    return {**out, **window_fields(where, hf.get("sliding_window"), None, n)}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    p = llama.prefix_of(tensor_names)
    out = {"tok_emb.weight": Recipe(f"{p}embed_tokens.weight"), "final_norm.weight": Recipe(f"{p}norm.weight"),
           "final_norm.bias": Recipe(f"{p}norm.bias")}
    mlp = ("weight", "bias") if linear_bias(m, "mlp") else ("weight",)
    for i in range(m["n_layers"]):
        h, o = f"{p}layers.{i}.", f"layers.{i}."
        out.update(llama.layer_recipes(m, h, o, mlp=False))  # attention (biases as use_bias) and norm weights
        for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
            out[f"{o}{ours}.bias"] = Recipe(f"{h}{theirs}.bias")
        for ours, theirs in (("up_proj", "c_fc"), ("down_proj", "c_proj")):
            for kind in mlp:
                out[f"{o}mlp.{ours}.{kind}"] = Recipe(f"{h}mlp.{theirs}.{kind}")
    if not m["tie_embeddings"]:
        out["head.weight"] = Recipe("lm_head.weight")
    return out


def misses(m: dict[str, Any]) -> list[str]:
    out = family_misses(m, MODEL_TYPE, {"pos_embedding": "rope", "norm": "layernorm", "norm_placement": "pre",
                                        "bias": True, "n_experts": 0}, {(True,) * 3, (False,) * 3},
                        {"sliding_window"}, window_patterns="all")
    if m.get("activation") not in ACT_HF:
        out.append(f"activation={m.get('activation')!r} (needs {', '.join(ACT_HF)})")
    return out


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    heads = m["n_heads"]
    return {"hidden_size": m["d_model"], "num_hidden_layers": m["n_layers"], "num_attention_heads": heads,
            "num_key_value_heads": m.get("n_kv_heads") or heads, "head_dim": head_dim(m),
            "intermediate_size": m.get("d_ff") or 4 * m["d_model"],
            "max_position_embeddings": m["max_seq_len"], "norm_epsilon": m["norm_eps"],
            "hidden_act": ACT_HF[m["activation"]], **rope_hf(m), "use_bias": bool(m.get("attn_qkv_bias", True)),
            "sliding_window": m.get("sliding_window") or None, **{k: m.get("dropout", 0.0) for k in DROPOUTS}}


FAMILY = Family(MODEL_TYPE, "Starcoder2ForCausalLM", to_model, read_plan, misses, to_hf)
