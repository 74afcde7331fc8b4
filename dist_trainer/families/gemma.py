"""Gemma (``GemmaForCausalLM``): Llama with a GeGLU MLP (tanh GELU), RMSNorms that multiply by (1 + w), the
embedding scaled by sqrt(hidden_size), a tied head and a ``head_dim`` of its own (256 when config.json leaves it
out). The (1 + w) norms are stored as w and read as such: ``norm_weight_offset: 1``, no conversion.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import llama
from dist_trainer.families.base import Family
from dist_trainer.families.common import refuse, require
from dist_trainer.families.decoder import family_misses

MODEL_TYPE = "gemma"
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")  # ACT2FN's tanh approximations
GEMMA = {"pos_embedding": "rope", "norm": "rmsnorm", "activation": "geglu", "bias": False, "n_experts": 0,
         "norm_weight_offset": 1.0, "scale_embeddings": True}
BIASES = {(False, False, False), (True, True, False)}  # attention_bias sets q, k, v and o; the MLP has none


def gemma_fields(hf: dict[str, Any], where: str, act_key: str, acts: tuple[str, ...]) -> dict[str, Any]:
    """The fields every Gemma shares: Llama's keys with the activation under ``act_key`` (one of ``acts``)."""
    act = hf.get(act_key, "gelu_pytorch_tanh")
    if act not in acts:
        raise refuse(where, act_key, act, f"the gated MLP of this family is GeGLU: {', '.join(acts)}")
    require(hf, where, "use_bidirectional_attention", (None, False), "the model is read as a causal decoder")
    llama_keys = {"head_dim": 256, **{k: v for k, v in hf.items() if k not in ("hidden_act", "mlp_bias")}}
    return {**llama.fields(llama_keys, where), "activation": "geglu", "norm_weight_offset": 1.0,
            "scale_embeddings": True, "tie_embeddings": bool(hf.get("tie_word_embeddings", True))}


def gemma_keys(m: dict[str, Any]) -> dict[str, Any]:
    """Llama's config.json keys of ``m`` without its activation and MLP bias (a Gemma has neither key)."""
    return {k: v for k, v in llama.hf_keys(m).items() if k not in ("hidden_act", "mlp_bias")}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    # GemmaConfig reads a legacy hidden_act "gelu" as the tanh approximation (the releases meant it so)
    return gemma_fields(hf, where, "hidden_act", ("gelu", *TANH_GELU))


def misses(m: dict[str, Any]) -> list[str]:
    return family_misses(m, MODEL_TYPE, {**GEMMA, "norm_placement": "pre"}, BIASES, set())


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {**gemma_keys(m), "hidden_act": "gelu_pytorch_tanh"}


FAMILY = Family(MODEL_TYPE, "GemmaForCausalLM", to_model, llama.read_plan, misses, to_hf)
