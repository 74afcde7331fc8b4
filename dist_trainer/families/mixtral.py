"""Mixtral (``MixtralForCausalLM``): Llama's attention, a sparse MoE MLP in every layer.

Its experts ``w1, w3, w2`` are our ``gate_proj, up_proj, down_proj``, its ``gate`` our ``router``: softmax top-k,
the chosen gates renormalised. Mixtral's experts are dropless (every token reaches its top-k experts), so a Mixtral
folder maps to ``capacity_factor: none`` (dropless routing) and the forward pass is Mixtral's; a run may still set
a capacity (``docs/huggingface.md``).
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import need, refuse
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "mixtral"


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    llama.refuse_window(hf, where)
    out = llama.fields(hf, where, biases=False)
    if float(hf.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise refuse(where, "router_jitter_noise", hf["router_jitter_noise"], "the router here has no jitter")
    experts, top_k = int(hf["num_local_experts"]), int(hf.get("num_experts_per_tok", 2))
    out.update(n_experts=experts, top_k=top_k, capacity_factor=None, moe_every=1,
               router_aux_loss=float(hf.get("router_aux_loss_coef", 0.001)), router_z_loss=0.0, n_shared_experts=0)
    return out


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    p = llama.prefix_of(tensor_names)
    out = llama.model_recipes(m, p, mlp=False)
    for i in range(m["n_layers"]):
        moe = f"{p}layers.{i}.block_sparse_moe."
        out[f"layers.{i}.moe.router.weight"] = Recipe(f"{moe}gate.weight")
        for e in range(m["n_experts"]):
            for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                out[f"layers.{i}.moe.experts.{e}.{ours}.weight"] = Recipe(f"{moe}experts.{e}.{theirs}.weight")
    return out


def misses(m: dict[str, Any]) -> list[str]:
    if not m.get("n_experts"):
        return ["n_experts=0 (needs experts)"]
    return need(m, moe_every=1) + llama.llama_misses(m, {"n_experts"}, MODEL_TYPE, biases=False)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {**llama.hf_keys(m), "num_local_experts": m["n_experts"], "num_experts_per_tok": m["top_k"],
            "router_aux_loss_coef": m["router_aux_loss"], "router_jitter_noise": 0.0, "sliding_window": None,
            "output_router_logits": False}


FAMILY = Family(MODEL_TYPE, "MixtralForCausalLM", to_model, read_plan, misses, to_hf,
                presets=("mixtral-8x7b", "tiny-moe"))
