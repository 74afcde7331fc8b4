"""Qwen3 (``Qwen3ForCausalLM``): Llama with an RMSNorm on each head of q and k (one weight shared by the heads,
before RoPE: ``qk_norm: head``) and a ``head_dim`` of its own (128 when config.json leaves it out).

``attention_bias`` sets q, k, v and o biases; the MLP has none. The q/k norm weights are permuted like the rows of
one head (``recipe.py``). Sliding windows as Qwen2's.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import head_dim
from dist_trainer.families.decoder import family_misses
from dist_trainer.families.qwen2 import FIXED, qwen_window_keys, qwen_windows
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "qwen3"


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    out = llama.fields({"head_dim": 128, **{k: v for k, v in hf.items() if k != "mlp_bias"}}, where)
    # head_dim is a key of Qwen3's own (128 by default): stated even where it is hidden_size / heads
    return {**out, "attn_head_dim": int(hf.get("head_dim", 128)), "qk_norm": "head", **qwen_windows(hf, where)}


def qk_norm_recipes(m: dict[str, Any], h: str, o: str) -> dict[str, Recipe]:
    """q_norm / k_norm of HF layer ``h`` as ours in layer ``o``: their rows in the RoPE order of one head (per head,
    or across every head of the full width)."""
    return {f"{o}attn.{x}_norm.weight": Recipe(f"{h}self_attn.{x}_norm.weight", rope_head_dim=head_dim(m))
            for x in "qk"}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    out = llama.read_plan(m, tensor_names)
    p = llama.prefix_of(tensor_names)
    for i in range(m["n_layers"]):
        out.update(qk_norm_recipes(m, f"{p}layers.{i}.", f"layers.{i}."))
    return out


def misses(m: dict[str, Any]) -> list[str]:
    return family_misses(m, MODEL_TYPE, {**FIXED, "qk_norm": "head"}, {(False, False, False), (True, True, False)},
                         {"sliding_window"}, window_patterns="all")


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {**{k: v for k, v in llama.hf_keys(m).items() if k != "mlp_bias"}, **qwen_window_keys(m)}


FAMILY = Family(MODEL_TYPE, "Qwen3ForCausalLM", to_model, read_plan, misses, to_hf, presets=("qwen3-8b",))
