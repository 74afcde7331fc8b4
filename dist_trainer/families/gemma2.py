"""Gemma 2 (``Gemma2ForCausalLM``): Gemma with sandwich norms, soft-capped attention scores and logits, q.k scaled by
``query_pre_attn_scalar ** -0.5``, and a sliding window on every other layer (``layer_types``).

Each layer's ``input_layernorm`` and ``post_attention_layernorm`` are our ``attn_norm`` and ``attn_post_norm``,
``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` our ``mlp_norm`` and ``mlp_post_norm``.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.decoder import FULL, SLIDING, family_misses, layer_types, window_fields
from dist_trainer.families.gemma import BIASES, GEMMA, TANH_GELU, gemma_fields, gemma_keys
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "gemma2"
SANDWICH = {**GEMMA, "norm_placement": "sandwich"}


def sandwich_fields(hf: dict[str, Any], where: str, softcaps: tuple[float | None, float | None],
                    pattern: int) -> dict[str, Any]:
    """Gemma 2 and 3's fields past Gemma's (``softcaps``: the defaults of the attention and final soft-caps;
    ``pattern``: every pattern-th layer is global when config.json has no layer_types)."""
    n = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    attn_cap, final_cap = (hf.get(k, default) for k, default in zip(
        ("attn_logit_softcapping", "final_logit_softcapping"), softcaps))
    return {**gemma_fields(hf, where, "hidden_activation", TANH_GELU), "norm_placement": "sandwich",
            "attn_score_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": float(attn_cap or 0.0), "final_softcap": float(final_cap or 0.0),
            **window_fields(where, hf.get("sliding_window", 4096), kinds, n)}


def sandwich_keys(m: dict[str, Any]) -> dict[str, Any]:
    scalar = (m.get("attn_score_scale") or (m.get("attn_head_dim") or m["d_model"] // m["n_heads"]) ** -0.5) ** -2
    return {**gemma_keys(m), "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
            "attn_logit_softcapping": m.get("attn_softcap") or None,
            "final_logit_softcapping": m.get("final_softcap") or None,
            "sliding_window": m.get("sliding_window") or None, "layer_types": layer_types(m)}


def sandwich_recipes(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    out = llama.read_plan(m, tensor_names)
    p = llama.prefix_of(tensor_names)
    for i in range(m["n_layers"]):
        h, o = f"{p}layers.{i}.", f"layers.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("attn_post_norm", "post_attention_layernorm"),
                             ("mlp_norm", "pre_feedforward_layernorm"),
                             ("mlp_post_norm", "post_feedforward_layernorm")):
            out[f"{o}{ours}.weight"] = Recipe(f"{h}{theirs}.weight")
    return out


SANDWICH_MAPPED = {"attn_score_scale", "attn_softcap", "final_softcap", "sliding_window"}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    return sandwich_fields(hf, where, (50.0, 30.0), 2)


def misses(m: dict[str, Any]) -> list[str]:
    return family_misses(m, MODEL_TYPE, SANDWICH, BIASES, SANDWICH_MAPPED)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    return sandwich_keys(m)


FAMILY = Family(MODEL_TYPE, "Gemma2ForCausalLM", to_model, sandwich_recipes, misses, to_hf,
                presets=("gemma-2-9b",))
