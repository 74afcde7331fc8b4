"""OLMo 2 (``Olmo2ForCausalLM``): Llama with its norms after each branch (``norm_placement: post_branch``) and an
RMSNorm over all of q's features and all of k's (``qk_norm: full``), before RoPE.

Each layer's ``post_attention_layernorm`` and ``post_feedforward_layernorm`` are our ``attn_norm`` and ``mlp_norm``;
the q/k norm weights are permuted per head like the rows of q and k (``recipe.py``).
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.decoder import family_misses, refuse_window
from dist_trainer.families.qwen3 import qk_norm_recipes
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "olmo2"
FIXED = {"pos_embedding": "rope", "norm": "rmsnorm", "norm_placement": "post_branch", "activation": "swiglu",
         "bias": False, "n_experts": 0, "qk_norm": "full"}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    refuse_window(hf, where, MODEL_TYPE)
    out = llama.fields({k: v for k, v in hf.items() if k != "mlp_bias"}, where)  # the MLP has no biases
    return {**out, "norm_placement": "post_branch", "qk_norm": "full"}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    out = llama.read_plan(m, tensor_names)
    p = llama.prefix_of(tensor_names)
    for i in range(m["n_layers"]):
        h, o = f"{p}layers.{i}.", f"layers.{i}."
        out[f"{o}attn_norm.weight"] = Recipe(f"{h}post_attention_layernorm.weight")
        out[f"{o}mlp_norm.weight"] = Recipe(f"{h}post_feedforward_layernorm.weight")
        out.update(qk_norm_recipes(m, h, o))
    return out


def misses(m: dict[str, Any]) -> list[str]:
    return family_misses(m, MODEL_TYPE, FIXED, {(False, False, False), (True, True, False)}, set())


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {k: v for k, v in llama.hf_keys(m).items() if k != "mlp_bias"}


FAMILY = Family(MODEL_TYPE, "Olmo2ForCausalLM", to_model, read_plan, misses, to_hf, presets=("olmo-2-7b",))
