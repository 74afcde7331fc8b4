"""GPT-NeoX and Pythia (``GPTNeoXForCausalLM``): LayerNorms with biases, an MLP with biases, q/k/v/o biases when
``attention_bias`` (the default), the parallel residual ``x + attn(ln1(x)) + mlp(ln2(x))`` when
``use_parallel_residual`` (the default), RoPE on the first ``rotary_pct`` of each head (0.25 by default, base
``rotary_emb_base``) and an untied head ``embed_out``.

``query_key_value`` holds each head's q, k and v rows one after the other ([q_h; k_h; v_h] per head): ours are
rows [0, D), [D, 2D), [2D, 3D) of every block of 3D rows (``Recipe.period``), so a TP rank reads its heads alone.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families.base import Family
from dist_trainer.families.common import head_dim, linear_bias, one_dropout, prefix, refuse, rope_fields, rope_hf
from dist_trainer.families.decoder import family_misses, rotary_fraction
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "gpt_neox"
ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
ACT_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
DROPOUTS = ("hidden_dropout", "attention_dropout")
FIXED = {"pos_embedding": "rope", "norm": "layernorm", "norm_placement": "pre", "bias": True, "n_experts": 0}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in ACT:
        raise refuse(where, "hidden_act", act, f"activations: {', '.join(ACT)}")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    bias = bool(hf.get("attention_bias", True))
    rope = rope_fields({**hf, "rope_theta": hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0))}, where)
    return {"vocab_size": int(hf["vocab_size"]), "d_model": d, "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": heads, "n_kv_heads": None, "d_ff": int(hf["intermediate_size"]),
            "max_seq_len": int(hf.get("max_position_embeddings", 2048)), "pos_embedding": "rope", **rope,
            **rotary_fraction(hf, 0.25), "norm": "layernorm", "norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
            "norm_placement": "pre", "activation": ACT[act], "bias": True, "attn_qkv_bias": bias,
            "attn_out_bias": bias, "mlp_bias": True, "parallel_residual": bool(hf.get("use_parallel_residual", True)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "dropout": one_dropout(hf, where, DROPOUTS), "causal": True, "n_token_types": 0, "pooler": False}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    p = prefix(tensor_names, "embed_in.weight", ("gpt_neox.", ""))
    hd = head_dim(m)
    rope = int(hd * m.get("rotary_fraction", 1.0))
    rope_dims = 0 if rope == hd else rope
    out = {"tok_emb.weight": Recipe(f"{p}embed_in.weight")}
    for kind in ("weight", "bias"):
        out[f"final_norm.{kind}"] = Recipe(f"{p}final_layer_norm.{kind}")
    attn = ("weight", "bias") if linear_bias(m, "qkv") else ("weight",)
    for i in range(m["n_layers"]):
        h, o = f"{p}layers.{i}.", f"layers.{i}."
        for kind in attn:
            for j, leaf in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{o}attn.{leaf}.{kind}"] = Recipe(
                    f"{h}attention.query_key_value.{kind}", offset=j * hd, rows=hd, period=3 * hd,
                    rope_head_dim=hd if j < 2 else 0, rope_dims=rope_dims if j < 2 else 0)
            out[f"{o}attn.o_proj.{kind}"] = Recipe(f"{h}attention.dense.{kind}")
        for ours, theirs in (("mlp.up_proj", "mlp.dense_h_to_4h"), ("mlp.down_proj", "mlp.dense_4h_to_h"),
                             ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
            for kind in ("weight", "bias"):
                out[f"{o}{ours}.{kind}"] = Recipe(f"{h}{theirs}.{kind}")
    if not m["tie_embeddings"]:
        out["head.weight"] = Recipe("embed_out.weight")
    return out


def misses(m: dict[str, Any]) -> list[str]:
    out = family_misses(m, MODEL_TYPE, FIXED, {(True, True, True), (False, False, True)},
                        {"parallel_residual", "rotary_fraction"})
    if m.get("activation") not in ACT_HF:
        out.append(f"activation={m.get('activation')!r} (needs {', '.join(ACT_HF)})")
    if m.get("n_kv_heads") not in (None, m["n_heads"]) or m.get("attn_head_dim") not in (None, head_dim(m)):
        out.append(f"n_kv_heads={m.get('n_kv_heads')!r}, attn_head_dim={m.get('attn_head_dim')!r} (GPT-NeoX's "
                   "heads are hidden_size / num_attention_heads wide, each with its own k and v)")
    return out


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    rope = rope_hf(m)
    return {"hidden_size": m["d_model"], "num_hidden_layers": m["n_layers"], "num_attention_heads": m["n_heads"],
            "intermediate_size": m.get("d_ff") or 4 * m["d_model"], "max_position_embeddings": m["max_seq_len"],
            "layer_norm_eps": m["norm_eps"], "hidden_act": ACT_HF[m["activation"]],
            "use_parallel_residual": bool(m.get("parallel_residual")), "attention_bias": linear_bias(m, "qkv"),
            "rotary_pct": m.get("rotary_fraction", 1.0), "rotary_emb_base": rope.pop("rope_theta"), **rope,
            **{k: m.get("dropout", 0.0) for k in DROPOUTS}}


FAMILY = Family(MODEL_TYPE, "GPTNeoXForCausalLM", to_model, read_plan, misses, to_hf)
