"""Qwen3-MoE (``Qwen3MoeForCausalLM``, Qwen3-30B-A3B and Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm,
``head_dim`` of its own: hidden_size / heads when absent, as transformers' Qwen3MoeAttention), softmax top-k over
``num_experts`` experts of ``moe_intermediate_size`` (renormalised with ``norm_topk_prob``), no shared expert, dense
layers where ``mlp_only_layers`` or ``decoder_sparse_step`` say. Routing is dropless. Sliding windows are refused.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import need
from dist_trainer.families.decoder import family_misses
from dist_trainer.families.moe import mlp_recipes, qwen_dense_layers, router_fields, router_keys
from dist_trainer.families.qwen2_moe import refuse_moe_window
from dist_trainer.families.qwen3 import qk_norm_recipes
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "qwen3_moe"
FIXED = {"pos_embedding": "rope", "norm": "rmsnorm", "norm_placement": "pre", "activation": "swiglu", "bias": False,
         "qk_norm": "head", "router_score": "softmax"}
MAPPED = {"n_experts", "moe_d_ff", "moe_dense_layers", "norm_topk_prob"}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    refuse_moe_window(hf, where)
    experts = "num_experts" if "num_experts" in hf else "num_local_experts"  # transformers 5 writes the latter
    out = llama.fields({k: v for k, v in hf.items() if k != "mlp_bias"}, where)
    return {**out, **router_fields(hf, where, experts, default_norm=False), "qk_norm": "head",
            "moe_dense_layers": qwen_dense_layers(hf, where)}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    p = llama.prefix_of(tensor_names)
    out = llama.model_recipes(m, p, mlp=False)
    for i in range(m["n_layers"]):
        h, o = f"{p}layers.{i}.", f"layers.{i}."
        out.update({**qk_norm_recipes(m, h, o), **mlp_recipes(m, h, o)})
    return out


def misses(m: dict[str, Any]) -> list[str]:
    if not m.get("n_experts"):
        return ["n_experts=0 (needs experts)"]
    return need(m, moe_every=1) + family_misses(m, MODEL_TYPE, FIXED, {(False, False, False), (True, True, False)},
                                                MAPPED)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    keys = {k: v for k, v in llama.hf_keys(m).items() if k != "mlp_bias"}
    return {**keys, **router_keys(m, "num_experts"), "use_sliding_window": False, "sliding_window": None}


FAMILY = Family(MODEL_TYPE, "Qwen3MoeForCausalLM", to_model, read_plan, misses, to_hf, presets=("qwen3-30b-a3b",))
