"""Model families: one module each, found by the ``model_type`` of a Hugging Face config.json (torch-free).

A family (``base.Family``) maps its config.json into ModelConfig fields and back, names its tensors both ways
(``recipe.Recipe``) and says which ModelConfig fields it cannot hold (``misses``). ``checkpoint/`` reads and writes
folders through these alone: no module outside this folder names a family (``tests/test_architecture.py``).
Adding one: its module here, its line in ``FAMILIES``, its presets (``docs/architecture.md``).
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families import (
    bert,
    deepseek_v3,
    gemma,
    gemma2,
    gemma3_text,
    gpt2,
    gpt_neox,
    granite,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    starcoder2,
    t5,
)
from dist_trainer.families.base import Family, Fields
from dist_trainer.families.common import MATHS_DEFAULTS, check_value_types
from dist_trainer.families.recipe import Recipe

__all__ = ["FAMILIES", "Family", "Recipe", "family", "family_for_model", "model_fields"]

# model_type -> Family; the order is export's preference: a model two families compute exports as the first
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    gpt2.FAMILY,
    llama.FAMILY,
    mistral.FAMILY,
    mixtral.FAMILY,
    bert.FAMILY,
    t5.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    gemma.FAMILY,
    gemma2.FAMILY,
    gemma3_text.FAMILY,
    phi3.FAMILY,
    olmo2.FAMILY,
    granite.FAMILY,
    starcoder2.FAMILY,
    gpt_neox.FAMILY,
    deepseek_v3.FAMILY,
)}


def family(model_type: Any, where: str = "config.json") -> Family:
    """The family of a config.json's ``model_type``; ValueError naming it and the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def model_fields(hf: dict[str, Any], where: str = "config.json", tensor_names: set[str] | None = None) -> Fields:
    """ModelConfig fields of a config.json (``tensor_names``: the folder's tensor names, which say whether a BERT
    folder has a pooler and a masked-LM head, a T5 one an untied head): every maths field stated, those the family
    leaves out at their defaults, and ``hf_family`` the folder's own (what an export writes back). ValueError naming
    the first key that cannot be mapped."""
    own = family(hf.get("model_type"), where)
    check_value_types(hf, where)
    return {**MATHS_DEFAULTS, **own.to_model(hf, where, tensor_names or set()), "hf_family": own.model_type}


def family_for_model(model: Fields) -> Family:
    """The family an export of ModelConfig fields ``model`` writes: the model's own ``hf_family`` (the folder it was
    read from, its preset's) when that family computes it exactly (a Phi-3 folder with full rotary computes what
    Mistral does, and still goes back as Phi-3), else the first family in registry order that does; ValueError
    naming what the closest family lacks (export then needs ``--format native``)."""
    own = FAMILIES.get(model.get("hf_family"))  # type: ignore[arg-type]
    if own is not None and not own.misses(model):
        return own
    missed = {name: f.misses(model) for name, f in FAMILIES.items()}
    for name, why in missed.items():
        if not why:
            return FAMILIES[name]
    closest = min(missed, key=lambda name: len(missed[name]))
    raise ValueError(f"this model is no Hugging Face family's; the closest, {closest}, lacks "
                     f"{'; '.join(missed[closest])}; export it with --format native")
