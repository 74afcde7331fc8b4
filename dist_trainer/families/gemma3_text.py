"""Gemma 3's text model (``Gemma3ForCausalLM``): Gemma 2's layers (no soft-caps unless config.json sets them) with
an RMSNorm on each head of q and k, five sliding layers to one global by default, and the sliding layers' own
RoPE base (``rope_local_theta``, never scaled).

RoPE keys: transformers 5's ``rope_parameters`` per layer type (``full_attention``, ``sliding_attention``), or
transformers 4's ``rope_theta`` (global), ``rope_scaling`` (global only) and ``rope_local_base_freq``.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import refuse, rope_fields, rope_hf
from dist_trainer.families.decoder import SLIDING, family_misses
from dist_trainer.families.gemma import BIASES
from dist_trainer.families.gemma2 import SANDWICH, SANDWICH_MAPPED, sandwich_fields, sandwich_keys, sandwich_recipes
from dist_trainer.families.qwen3 import qk_norm_recipes
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "gemma3_text"


def _rope(hf: dict[str, Any], where: str) -> tuple[dict[str, Any], float]:
    """(global RoPE fields, the sliding layers' base)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise refuse(where, "rope_parameters.sliding_attention", local, "the sliding layers' RoPE is unscaled")
        return rope_fields({"rope_parameters": {"rope_theta": 1e6, **(params.get("full_attention") or {})}},
                           where), float(local.get("rope_theta", 10000.0))
    return rope_fields({"rope_theta": 1e6, **hf}, where), float(hf.get("rope_local_base_freq", 10000.0))


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
    out = {**sandwich_fields(hf, where, (None, None), pattern), "qk_norm": "head"}
    global_rope, local_theta = _rope(hf, where)
    out.update(global_rope)
    if out.get("sliding_window"):
        out["rope_local_theta"] = local_theta
    elif hf.get("sliding_window", 4096) is None and local_theta != out["rope_theta"] and (
            SLIDING in (hf.get("layer_types") or [SLIDING])):
        # transformers turns the local RoPE base on by layer type, whether or not a window masks those layers
        raise refuse(where, "sliding_window", None, "the sliding layers' own RoPE base is mapped with their window")
    return out


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    out = sandwich_recipes(m, tensor_names)
    p = llama.prefix_of(tensor_names)
    for i in range(m["n_layers"]):
        out.update(qk_norm_recipes(m, f"{p}layers.{i}.", f"layers.{i}."))
    return out


def misses(m: dict[str, Any]) -> list[str]:
    return family_misses(m, MODEL_TYPE, {**SANDWICH, "qk_norm": "head"}, BIASES,
                         {*SANDWICH_MAPPED, "rope_local_theta"})


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    keys = {k: v for k, v in sandwich_keys(m).items() if k not in ("rope_theta", "rope_scaling")}
    local = {"rope_type": "default", "rope_theta": m.get("rope_local_theta") or m["rope_theta"]}
    full = {"rope_type": "default", **rope_hf(m).get("rope_scaling", {}), "rope_theta": m["rope_theta"]}
    return {**keys, "rope_parameters": {"full_attention": full, "sliding_attention": local}}


FAMILY = Family(MODEL_TYPE, "Gemma3ForCausalLM", to_model, read_plan, misses, to_hf, presets=("gemma-3-1b",))
