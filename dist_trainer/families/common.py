"""Helpers the family modules share: refusals naming key and value, dropout and RoPE keys, what a family lacks."""

from __future__ import annotations

import json
from typing import Any

# ModelConfig fields that change the forward pass beyond a family's basic shape, at their ModelConfig defaults
# (tests/test_families.py checks these against config_model.ModelConfig). A folder states every one of them (the
# registry fills those a family leaves out), and a family must map each one that differs before it exports it.
MATHS_DEFAULTS: dict[str, Any] = {
    "attn_qkv_bias": None, "attn_out_bias": None, "mlp_bias": None, "attn_head_dim": None, "qk_norm": "none",
    "norm_weight_offset": 0.0, "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attn_score_scale": None,
    "logits_divisor": 1.0, "attn_softcap": 0.0, "final_softcap": 0.0, "sliding_window": 0,
    "sliding_window_pattern": 0, "rope_local_theta": None, "parallel_residual": False, "rotary_fraction": 1.0,
    "rope_scaling": "none", "scale_embeddings": False, "scale_head_input": False, "attn_scale": True,
    "n_experts": 0, "n_shared_experts": 0, "moe_d_ff": None, "moe_dense_layers": [], "router_score": "softmax",
    "norm_topk_prob": True, "routed_scaling_factor": 1.0, "router_groups": 1, "router_topk_groups": 1,
    "expert_bias": False, "shared_expert_gate": False, "n_decoder_layers": 0, "mlm_head": False, "pooler": False,
    "n_token_types": 0, "causal": True, "kv_lora_rank": 0,
}


# config.json keys that are counts wherever a family reads them: an integer (JSON 2.5 or true is refused by name,
# never truncated to 2 or read as 1)
COUNT_KEYS = frozenset({
    "vocab_size", "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer", "num_layers",
    "num_decoder_layers", "num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "intermediate_size",
    "n_inner", "d_ff", "d_kv", "head_dim", "max_position_embeddings", "n_positions", "n_ctx", "type_vocab_size",
    "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace", "decoder_sparse_step", "n_group",
    "topk_group", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "sliding_window", "sliding_window_pattern", "relative_attention_num_buckets", "relative_attention_max_distance",
})


def check_value_types(hf: dict[str, Any], where: str) -> None:
    """ValueError naming the first key of a config.json whose value has the wrong JSON type for every family: a count
    that is not an integer, a RoPE base that is not a number > 0, RoPE parameters that are not an object."""
    for key in sorted(COUNT_KEYS & hf.keys()):
        value = hf[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise refuse(where, key, value, "a count: an integer")
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise refuse(where, key, hf[key], "RoPE parameters: an object, or null")
    for theta in (hf.get("rope_theta"), (hf.get("rope_parameters") or {}).get("rope_theta")):
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0):
            raise refuse(where, "rope_theta", theta, "RoPE's base: a number > 0")


def refuse(where: str, key: str, value: Any, why: str) -> ValueError:
    """The error for a config.json key this model cannot compute: names the file, the key and its value."""
    return ValueError(f"{where}: {key}: {json.dumps(value)} is not supported ({why})")


def require(hf: dict[str, Any], where: str, key: str, allowed: tuple[Any, ...], why: str) -> None:
    if key in hf and hf[key] not in allowed:
        raise refuse(where, key, hf[key], why)


def one_dropout(hf: dict[str, Any], where: str, keys: tuple[str, ...]) -> float:
    """One dropout rate for embeddings, attention and residuals (the model has one); refused when they differ."""
    values = {k: float(hf[k]) for k in keys if hf.get(k) is not None}
    if len(set(values.values())) > 1:
        raise ValueError(f"{where}: dropout rates {values} differ; this model applies one rate (model.dropout) to "
                         "embeddings, attention and residual branches")
    return next(iter(values.values()), 0.0)


def prefix(hf_names: set[str], anchor: str, prefixes: tuple[str, ...]) -> str:
    """The prefix of a task model's tensor names (``model.``, ``transformer.``, none for a bare ``*Model``) read off
    the folder's names; the first of ``prefixes`` (an export's) when none matches."""
    for p in prefixes:
        if p + anchor in hf_names:
            return p
    return prefixes[0]


def rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """rope_theta and rope_scaling (transformers 4: ``rope_theta`` + ``rope_scaling``; 5: ``rope_parameters``)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    given = [(key, d, d.get("rope_type") or d.get("type")) for key, d in (("rope_parameters", params),
                                                                           ("rope_scaling", scaling))]
    given = [(key, d, kind) for key, d, kind in given if kind not in (None, "default")]

    def core(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in ("rope_theta", "type", "rope_type")}

    if len({kind for _, _, kind in given}) > 1 or (len(given) > 1 and core(given[0][1]) != core(given[1][1])):
        raise refuse(where, "rope_scaling", scaling, f"it disagrees with rope_parameters {json.dumps(params)}")
    key, source, kind = given[0] if given else ("", {}, "default")
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_scaling_factor": float(source["factor"])}
    if kind == "llama3":
        return {**out, "rope_scaling": "llama3", "rope_scaling_factor": float(source["factor"]),
                "rope_low_freq_factor": float(source["low_freq_factor"]),
                "rope_high_freq_factor": float(source["high_freq_factor"]),
                "rope_original_max_seq_len": int(source["original_max_position_embeddings"])}
    raise refuse(where, key, source, "rope types this model computes: default, linear, llama3")


def rope_hf(model: dict[str, Any]) -> dict[str, Any]:
    """The config.json RoPE keys of ``model`` (the inverse of ``rope_fields``)."""
    out: dict[str, Any] = {"rope_theta": model["rope_theta"]}
    scaling = model.get("rope_scaling", "none")
    if scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": model["rope_scaling_factor"]}
    elif scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": model["rope_scaling_factor"],
                               "low_freq_factor": model["rope_low_freq_factor"],
                               "high_freq_factor": model["rope_high_freq_factor"],
                               "original_max_position_embeddings": model["rope_original_max_seq_len"]}
    return out


def head_dim(model: dict[str, Any]) -> int:
    """ModelConfig.head_dim of fields ``model``."""
    return model.get("attn_head_dim") or model["d_model"] // model["n_heads"]


def linear_bias(model: dict[str, Any], group: str) -> bool:
    """ModelConfig.linear_bias(group) of fields ``model`` (qkv, out, mlp)."""
    own = model.get({"qkv": "attn_qkv_bias", "out": "attn_out_bias", "mlp": "mlp_bias"}[group])
    return bool(model.get("bias", True) if own is None else own)


def need(model: dict[str, Any], **want: Any) -> list[str]:
    """Each field of ``model`` that is not its wanted value, as "field=value (needs X)"."""
    return [f"{k}={model.get(k)!r} (needs {v!r})" for k, v in want.items() if model.get(k, MATHS_DEFAULTS.get(k)) != v]


def unmapped(model: dict[str, Any], mapped: set[str] | frozenset[str], family: str) -> list[str]:
    """Each MATHS_DEFAULTS field off its default that ``family`` does not map, as "field=value (...)" (an explicit
    per-group bias equal to model.bias, or attn_head_dim equal to d_model / n_heads, is the default's maths)."""
    out = []
    for key, default in MATHS_DEFAULTS.items():
        value = model.get(key, default)
        if key in mapped or value == default:
            continue
        if key in ("attn_qkv_bias", "attn_out_bias", "mlp_bias") and value == model.get("bias", True):
            continue
        if key == "attn_head_dim" and value == model["d_model"] // model["n_heads"]:
            continue
        out.append(f"{key}={value!r} ({family} has no such setting)")
    return out
