"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): Llama with biases on q, k and v and none on o or the MLP.

A sliding window is used only when ``use_sliding_window`` is true, on the layers ``layer_types`` marks (from
``max_window_layers`` on when layer_types is absent); every layer sliding maps onto ``sliding_window``, any other
split is refused naming layer_types. The q/k biases are permuted with their rows (``recipe.py``).
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.decoder import FULL, SLIDING, family_misses, layer_types, window_fields

MODEL_TYPE = "qwen2"
FIXED = {"pos_embedding": "rope", "norm": "rmsnorm", "norm_placement": "pre", "activation": "swiglu", "bias": False,
         "n_experts": 0}


def qwen_windows(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The sliding window of a Qwen2/Qwen3 config.json (``Qwen2Config.__post_init__``)."""
    if not hf.get("use_sliding_window", False):
        return {}
    n, first = int(hf["num_hidden_layers"]), int(hf.get("max_window_layers", 28))
    kinds = hf.get("layer_types") or [SLIDING if i >= first else FULL for i in range(n)]
    return window_fields(where, hf.get("sliding_window", 4096), kinds, n)


def qwen_window_keys(m: dict[str, Any]) -> dict[str, Any]:
    window = m.get("sliding_window", 0)
    return {"use_sliding_window": bool(window), "sliding_window": window or None,
            "max_window_layers": 0 if window else m["n_layers"], "layer_types": layer_types(m)}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    # Qwen2's attention always has q/k/v biases and no others: attention_bias / mlp_bias keys change nothing
    out = llama.fields({k: v for k, v in hf.items() if k not in ("attention_bias", "mlp_bias")}, where)
    return {**out, "attn_qkv_bias": True, **qwen_windows(hf, where)}  # o and the MLP follow bias: none


def misses(m: dict[str, Any]) -> list[str]:
    return family_misses(m, MODEL_TYPE, FIXED, {(True, False, False)}, {"sliding_window"}, window_patterns="all")


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    keys = {k: v for k, v in llama.hf_keys(m).items() if k not in ("attention_bias", "mlp_bias")}
    return {**keys, **qwen_window_keys(m)}


FAMILY = Family(MODEL_TYPE, "Qwen2ForCausalLM", to_model, llama.read_plan, misses, to_hf, presets=("qwen2.5-7b",))
