"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi K2 and others reuse it): multi-head latent attention
(``mla_shape.py``) with YaRN RoPE, then a dense SwiGLU MLP in the first ``first_k_dense_replace`` layers and a
mixture of experts in the others (sigmoid router with group-limited top-k, ``e_score_correction_bias``, routed
scaling, ``n_shared_experts`` shared experts of ``moe_intermediate_size`` each).

Tensor names: ``self_attn.kv_a_proj_with_mqa`` and ``*_layernorm`` are our ``attn.kv_a_proj`` and ``attn.*_norm``;
q_pe and k_pe rows are stored in adjacent-pair order (``rope_interleave``: true, the checkpoints' layout), which is
ours, so no row is permuted. Multi-token-prediction layers (``num_nextn_predict_layers``; layer indices from
``num_hidden_layers`` on) are named as not loaded, as transformers ignores them; an export has none.
"""

from __future__ import annotations

import re
from typing import Any

from dist_trainer.families import llama, moe
from dist_trainer.families.base import Family
from dist_trainer.families.common import need, refuse, require, rope_fields, rope_hf
from dist_trainer.families.decoder import family_misses
from dist_trainer.families.moe import router_fields
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "deepseek_v3"
FIXED = {"pos_embedding": "rope", "norm": "rmsnorm", "norm_placement": "pre", "activation": "swiglu",
         "bias": False}
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
YARN_KEYS = {"beta_fast": "rope_yarn_beta_fast", "beta_slow": "rope_yarn_beta_slow", "mscale": "rope_yarn_mscale",
             "mscale_all_dim": "rope_yarn_mscale_all_dim"}
ATTN = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj",
        "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
        "o_proj": "o_proj"}  # ours -> transformers' under self_attn


def rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """rope_theta and the scaling: yarn mapped here (factor, original length, betas, mscales), the rest as
    ``common.rope_fields``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if (params.get("rope_type") or params.get("type")) != "yarn":
        return rope_fields(hf, where)
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise refuse(where, key, params, "yarn's attention_factor is computed from mscale and mscale_all_dim here, "
                     "and its correction range truncated")
    old = int(params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096))
    factor = params.get("factor")
    out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), "rope_scaling": "yarn",
           "rope_scaling_factor": float(factor) if factor is not None
           else int(hf["max_position_embeddings"]) / old, "rope_original_max_seq_len": old}
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}
    return {**out, **{ours: float(params.get(k) or defaults[k]) for k, ours in YARN_KEYS.items()}}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    require(hf, where, "rope_interleave", (True,), "q_pe and k_pe rotate adjacent pairs here (rope_interleave: "
            "true, the DeepSeek checkpoints' layout)")
    heads = int(hf["num_attention_heads"])
    require(hf, where, "num_key_value_heads", (None, heads), "latent attention gives every head its own keys")
    dense = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "mlp_bias")}
    out = llama.fields({**dense, "rope_theta": 10000.0}, where)
    out.update(rope(hf, where), n_kv_heads=heads, attn_qkv_bias=bool(hf.get("attention_bias", False)),
               attn_out_bias=bool(hf.get("attention_bias", False)))
    out.pop("attn_head_dim", None)  # head_dim is qk_rope_head_dim in transformers' config: not the heads' width
    out.update({k: int(hf.get(k) or 0) for k in MLA_KEYS})
    n, dense_layers = int(hf["num_hidden_layers"]), int(hf.get("first_k_dense_replace") or 0)
    if dense_layers < n and int(hf.get("n_routed_experts") or 0):
        out.update(moe_fields(hf, where, dense_layers))
    return out


def moe_fields(hf: dict[str, Any], where: str, dense_layers: int) -> dict[str, Any]:
    """The MoE layers (``first_k_dense_replace`` on): sigmoid scores, the expert bias on them for the choice only
    (``e_score_correction_bias``), the best 2 experts' sum picking ``topk_group`` of ``n_group`` groups, top-k within
    them, the chosen scores renormalised (``norm_topk_prob``) and times ``routed_scaling_factor``; dropless, no
    auxiliary loss (transformers computes none)."""
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        key = "scoring_func" if hf.get("scoring_func", "sigmoid") != "sigmoid" else "topk_method"
        raise refuse(where, key, hf[key], "DeepSeek-V3's router: sigmoid scores, noaux_tc top-k")
    out = router_fields({**hf, "router_aux_loss_coef": 0.0}, where, "n_routed_experts", default_norm=True)
    return {**out, "router_score": "sigmoid", "expert_bias": True, "n_shared_experts": int(hf.get("n_shared_experts")
            or 0), "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "router_groups": int(hf.get("n_group") or 1), "router_topk_groups": int(hf.get("topk_group") or 1),
            "moe_dense_layers": list(range(dense_layers))}


def layer_index(name: str) -> int | None:
    found = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def not_loaded(m: dict[str, Any], tensor_names: set[str]) -> dict[str, str]:
    """{HF tensor: why it is not read}: the multi-token-prediction layers' (index >= num_hidden_layers)."""
    return {name: f"multi-token-prediction layer {layer_index(name)} (num_nextn_predict_layers): not loaded, as "
                  "transformers does not load it" for name in sorted(tensor_names)
            if (layer_index(name) or 0) >= m["n_layers"]}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    p = llama.prefix_of(tensor_names)
    out = llama.model_recipes(m, p, mlp=False)
    out = {k: v for k, v in out.items() if ".attn." not in k}
    built = ("q_a_proj", "q_a_norm", "q_b_proj") if m.get("q_lora_rank") else ("q_proj",)
    for i in range(m["n_layers"]):
        h, o = f"{p}layers.{i}.", f"layers.{i}."
        for ours in (*built, "kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj"):
            out[f"{o}attn.{ours}.weight"] = Recipe(f"{h}self_attn.{ATTN[ours]}.weight")
        biased = ("q_a_proj", "kv_a_proj", "o_proj") if m.get("attn_qkv_bias") else ()
        for ours in (b for b in biased if b in built or b != "q_a_proj"):
            out[f"{o}attn.{ours}.bias"] = Recipe(f"{h}self_attn.{ATTN[ours]}.bias")
        out.update(mlp_recipes(m, h, o, i))
    return out


def mlp_recipes(m: dict[str, Any], h: str, o: str, layer: int) -> dict[str, Recipe]:
    """A dense layer's MLP, or a sparse one's router (``mlp.gate``), its bias buffer, experts and shared experts."""
    out = moe.mlp_recipes(m, h, o, shared="shared_experts")
    if moe.is_moe(m, layer):
        out[f"{o}moe.expert_bias"] = Recipe(f"{h}mlp.gate.e_score_correction_bias")
    return out


def misses(m: dict[str, Any]) -> list[str]:
    if not m.get("kv_lora_rank"):
        return ["kv_lora_rank=0 (deepseek_v3's attention is latent: needs kv_lora_rank > 0)"]
    out = []
    if m.get("n_experts"):
        dense = list(range(len(m.get("moe_dense_layers") or [])))
        out = need(m, moe_every=1, router_score="sigmoid", expert_bias=True, shared_expert_gate=False,
                   moe_dense_layers=dense, router_aux_loss=0.0, router_z_loss=0.0)
    mapped = {"kv_lora_rank", "n_kv_heads", "n_experts", "n_shared_experts", "moe_d_ff", "moe_dense_layers",
              "norm_topk_prob", "routed_scaling_factor", "router_groups", "router_topk_groups", "router_score",
              "expert_bias"}
    return out + family_misses(m, MODEL_TYPE, FIXED, {(False, False, False), (True, True, False)}, mapped,
                               rope_scalings=("none", "linear", "yarn"))


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    keys = {k: v for k, v in llama.hf_keys(m).items() if k not in ("head_dim", "mlp_bias", "rope_scaling")}
    if m.get("rope_scaling") == "yarn":
        keys["rope_scaling"] = {"rope_type": "yarn", "factor": m["rope_scaling_factor"],
                                "original_max_position_embeddings": m["rope_original_max_seq_len"],
                                **{k: m[ours] for k, ours in YARN_KEYS.items()}}
    else:
        keys.update(rope_hf(m))
    return {**keys, **{k: m[k] or None if k == "q_lora_rank" else m[k] for k in MLA_KEYS},
            "rope_interleave": True, "num_nextn_predict_layers": 0, **moe_keys(m)}


def moe_keys(m: dict[str, Any]) -> dict[str, Any]:
    """The router keys of an export (every layer dense without experts)."""
    if not m.get("n_experts"):
        return {"first_k_dense_replace": m["n_layers"], "n_routed_experts": 0, "n_shared_experts": 0}
    return {"first_k_dense_replace": len(m.get("moe_dense_layers") or []), "n_routed_experts": m["n_experts"],
            "num_experts_per_tok": m["top_k"], "moe_intermediate_size": moe.expert_width(m),
            "n_shared_experts": m.get("n_shared_experts", 0), "norm_topk_prob": m.get("norm_topk_prob", True),
            "routed_scaling_factor": m.get("routed_scaling_factor", 1.0), "n_group": m.get("router_groups", 1),
            "topk_group": m.get("router_topk_groups", 1), "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


FAMILY = Family(MODEL_TYPE, "DeepseekV3ForCausalLM", to_model, read_plan, misses, to_hf, not_loaded=not_loaded)
