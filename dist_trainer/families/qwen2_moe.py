"""Qwen1.5-MoE and Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v biases: ``qkv_bias``, true when
absent), softmax top-k routing over ``num_experts`` experts of ``moe_intermediate_size`` (the chosen gates
renormalised only with ``norm_topk_prob``, false by default), one shared expert of
``shared_expert_intermediate_size`` on every token scaled by sigmoid(``shared_expert_gate``), dense layers where
``mlp_only_layers`` or ``decoder_sparse_step`` say (of ``intermediate_size``). Routing is dropless, as transformers'.

The shared expert is ours ``n_shared_experts`` x ``moe_d_ff`` wide: its width must be a multiple of the routed
experts' (every published Qwen-MoE's is: 5632 = 4 x 1408, 20480 = 8 x 2560). Sliding windows are refused.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import need, refuse
from dist_trainer.families.decoder import family_misses
from dist_trainer.families.moe import expert_width, mlp_recipes, qwen_dense_layers, router_fields, router_keys
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "qwen2_moe"
FIXED = {"pos_embedding": "rope", "norm": "rmsnorm", "norm_placement": "pre", "activation": "swiglu", "bias": False,
         "shared_expert_gate": True, "router_score": "softmax"}
MAPPED = {"n_experts", "moe_d_ff", "moe_dense_layers", "norm_topk_prob", "n_shared_experts"}


def refuse_moe_window(hf: dict[str, Any], where: str) -> None:
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise refuse(where, "use_sliding_window", True, "the Qwen-MoE families are mapped with full attention")


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    refuse_moe_window(hf, where)
    out = llama.fields({k: v for k, v in hf.items() if k not in ("attention_bias", "mlp_bias")}, where)
    out.update(router_fields(hf, where, "num_experts", default_norm=False),
               moe_dense_layers=qwen_dense_layers(hf, where), attn_qkv_bias=bool(hf.get("qkv_bias", True)))
    shared, width = int(hf.get("shared_expert_intermediate_size", 0)), out["moe_d_ff"]
    if shared % width:
        raise refuse(where, "shared_expert_intermediate_size", shared, f"a multiple of moe_intermediate_size {width}")
    return {**out, "n_shared_experts": shared // width, "shared_expert_gate": bool(shared)}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    p = llama.prefix_of(tensor_names)
    out = llama.model_recipes(m, p, mlp=False)
    for i in range(m["n_layers"]):
        out.update(mlp_recipes(m, f"{p}layers.{i}.", f"layers.{i}.", shared="shared_expert",
                               shared_gate="shared_expert_gate"))
    return out


def misses(m: dict[str, Any]) -> list[str]:
    if not m.get("n_experts") or not m.get("n_shared_experts"):
        return [f"n_experts={m.get('n_experts')}, n_shared_experts={m.get('n_shared_experts')} (needs both)"]
    return need(m, moe_every=1) + family_misses(m, MODEL_TYPE, FIXED, {(True, False, False), (False, False, False)},
                                                MAPPED)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    keys = {k: v for k, v in llama.hf_keys(m).items() if k not in ("attention_bias", "mlp_bias")}
    return {**keys, **router_keys(m, "num_experts"), "qkv_bias": bool(m.get("attn_qkv_bias")),
            "shared_expert_intermediate_size": m["n_shared_experts"] * expert_width(m), "use_sliding_window": False,
            "sliding_window": None}


FAMILY = Family(MODEL_TYPE, "Qwen2MoeForCausalLM", to_model, read_plan, misses, to_hf)
