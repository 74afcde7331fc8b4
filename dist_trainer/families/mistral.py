"""Mistral (``MistralForCausalLM``): Llama's layers without biases, and a sliding window on every layer
(``sliding_window``: query i sees keys i - W < j <= i; null = full causal attention, which is then Llama's maths)."""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family

MODEL_TYPE = "mistral"


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    out = llama.fields(hf, where, biases=False)  # transformers' Mistral has no biases: refused, not ignored
    if hf.get("sliding_window") is not None:
        out["sliding_window"] = int(hf["sliding_window"])
    return out


def misses(m: dict[str, Any]) -> list[str]:
    return llama.llama_misses(m, {"sliding_window"}, MODEL_TYPE, biases=False)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    keys = llama.hf_keys(m)
    del keys["attention_bias"], keys["mlp_bias"]
    return {**keys, "sliding_window": m.get("sliding_window") or None}


FAMILY = Family(MODEL_TYPE, "MistralForCausalLM", to_model, llama.read_plan, misses, to_hf)
