"""Granite 3 (``GraniteForCausalLM``): Llama with four multipliers: the embedding's (``embedding_multiplier``),
each branch's before its residual add (``residual_multiplier``), q.k's in place of 1/sqrt(head_dim)
(``attention_multiplier``: ``attn_score_scale``), and the logits' divisor (``logits_scaling``).
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import head_dim

MODEL_TYPE = "granite"
MULTIPLIERS = {"embedding_multiplier": "embedding_multiplier", "residual_multiplier": "residual_multiplier",
               "attention_multiplier": "attn_score_scale", "logits_scaling": "logits_divisor"}  # HF key -> field


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    llama.refuse_window(hf, where)
    return {**llama.fields(hf, where), **{ours: float(hf.get(key, 1.0)) for key, ours in MULTIPLIERS.items()}}


def misses(m: dict[str, Any]) -> list[str]:
    return llama.llama_misses(m, set(MULTIPLIERS.values()), MODEL_TYPE)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    values = {**m, "attn_score_scale": m.get("attn_score_scale") or head_dim(m) ** -0.5}
    return {**llama.hf_keys(m), **{key: values.get(ours, 1.0) for key, ours in MULTIPLIERS.items()}}


FAMILY = Family(MODEL_TYPE, "GraniteForCausalLM", to_model, llama.read_plan, misses, to_hf)
