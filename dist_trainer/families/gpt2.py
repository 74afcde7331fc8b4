"""GPT-2 (``GPT2LMHeadModel``): learned positions, pre-norm LayerNorm, biases everywhere, ``Conv1D`` linears.

Its linears store (in, out): our (out, in) weights are their transposes, and PEFT adapters are ``fan_in_fan_out``.
The fused ``c_attn`` holds q, k and v side by side along its output features.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families.base import Family
from dist_trainer.families.common import need, one_dropout, prefix, refuse, require, unmapped
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "gpt2"
_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_ACT_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACT:
        raise refuse(where, "activation_function", act, f"activations: {', '.join(_ACT)}")
    require(hf, where, "scale_attn_weights", (True,), "attention is always scaled by 1/sqrt(head_dim)")
    require(hf, where, "scale_attn_by_inverse_layer_idx", (False,), "no per-layer attention scale")
    require(hf, where, "add_cross_attention", (False,), "decoder-only: no cross-attention")
    d = int(hf.get("n_embd", 768))
    return {"vocab_size": int(hf.get("vocab_size", 50257)), "d_model": d, "n_layers": int(hf.get("n_layer", 12)),
            "n_heads": int(hf.get("n_head", 12)), "n_kv_heads": None, "d_ff": hf.get("n_inner") or 4 * d,
            "max_seq_len": int(hf.get("n_positions", 1024)), "pos_embedding": "learned", "norm": "layernorm",
            "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)), "norm_placement": "pre",
            "activation": _ACT[act], "bias": True, "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "dropout": one_dropout(hf, where, ("resid_pdrop", "embd_pdrop", "attn_pdrop")), "causal": True,
            "n_token_types": 0, "pooler": False}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    p = prefix(tensor_names, "wte.weight", ("transformer.", ""))
    d = m["d_model"]
    out = {"tok_emb.weight": Recipe(f"{p}wte.weight"), "pos_emb.weight": Recipe(f"{p}wpe.weight"),
           "final_norm.weight": Recipe(f"{p}ln_f.weight"), "final_norm.bias": Recipe(f"{p}ln_f.bias")}
    for i in range(m["n_layers"]):
        h, o = f"{p}h.{i}.", f"layers.{i}."
        for j, leaf in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{o}attn.{leaf}.weight"] = Recipe(f"{h}attn.c_attn.weight", True, j * d, d)
            out[f"{o}attn.{leaf}.bias"] = Recipe(f"{h}attn.c_attn.bias", False, j * d, d)
        for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"),
                             ("mlp.down_proj", "mlp.c_proj")):
            out[f"{o}{ours}.weight"] = Recipe(f"{h}{theirs}.weight", transpose=True)
            out[f"{o}{ours}.bias"] = Recipe(f"{h}{theirs}.bias")
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for kind in ("weight", "bias"):
                out[f"{o}{ours}.{kind}"] = Recipe(f"{h}{theirs}.{kind}")
    if not m["tie_embeddings"]:
        out["head.weight"] = Recipe("lm_head.weight")
    return out


def misses(m: dict[str, Any]) -> list[str]:
    out = need(m, pos_embedding="learned", norm="layernorm", norm_placement="pre", bias=True, n_experts=0)
    if m.get("activation") not in _ACT_HF:
        out.append(f"activation={m.get('activation')!r} (needs gelu, gelu_tanh or relu)")
    if m.get("n_kv_heads") not in (None, m.get("n_heads")):
        out.append(f"n_kv_heads={m.get('n_kv_heads')!r} (GPT-2 has no grouped k/v heads)")
    return out + unmapped(m, {"n_experts"}, MODEL_TYPE)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {"n_embd": m["d_model"], "n_layer": m["n_layers"], "n_head": m["n_heads"],
            "n_inner": m.get("d_ff") or 4 * m["d_model"], "n_positions": m["max_seq_len"], "n_ctx": m["max_seq_len"],
            "layer_norm_epsilon": m["norm_eps"], "activation_function": _ACT_HF[m["activation"]],
            "resid_pdrop": m["dropout"], "embd_pdrop": m["dropout"], "attn_pdrop": m["dropout"]}


FAMILY = Family(MODEL_TYPE, "GPT2LMHeadModel", to_model, read_plan, misses, to_hf, fan_in_fan_out=True,
                presets=("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny"))
