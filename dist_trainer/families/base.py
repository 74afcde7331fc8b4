"""What a model family is: its config.json mapping both ways, its tensor recipes, its export names (torch-free)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dist_trainer.families.recipe import Recipe

Fields = dict[str, Any]  # ModelConfig fields, by name


@dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type``, as one module of ``dist_trainer/families/`` declares it.

    - ``to_model(hf, where, tensor_names)``: the ModelConfig fields of a config.json (``where``: the file, for
      messages; ``tensor_names``: the folder's tensor names, empty when unknown). Every key that changes the
      maths is mapped or refused with a ValueError naming the key and its value (``common.refuse``); fields
      left out take their ModelConfig defaults (the registry fills them: a folder states the whole model).
    - ``read_plan(model, tensor_names)``: {our parameter name: Recipe} for a folder holding ``tensor_names``;
      with an empty set, the names an export writes.
    - ``misses(model)``: why ModelConfig fields ``model`` are not this family's maths (``[]``: exportable as it),
      each a short "field=value (why)".
    - ``to_hf(model, dtype)``: the config.json keys of an export; the registry adds ``model_type``,
      ``architectures`` ([architecture]), ``vocab_size``, ``torch_dtype`` and ``tie_word_embeddings`` unless
      ``to_hf`` sets them itself.
    - ``write_plan(model)``: the recipes under the export's names when they are not ``read_plan(model, set())``'s.
    - ``peft_task_type``, ``fan_in_fan_out``: the PEFT ``adapter_config.json`` of an adapter-only export
      (``fan_in_fan_out``: the HF linears store (in, out), as GPT-2's ``Conv1D``).
    - ``presets``: the configs/models/ presets of this family (names without ``.yaml``).
    - ``not_loaded(model, tensor_names)``: {HF tensor: why} for a folder's tensors the model leaves unread on
      purpose, as transformers does (DeepSeek-V3's multi-token-prediction layers); named when a folder is read,
      never dropped silently. Any other tensor no recipe reads is refused.
    """

    model_type: str
    architecture: str
    to_model: Callable[[dict[str, Any], str, set[str]], Fields]
    read_plan: Callable[[Fields, set[str]], dict[str, Recipe]]
    misses: Callable[[Fields], list[str]]
    to_hf: Callable[[Fields, str], dict[str, Any]]
    write_plan: Callable[[Fields], dict[str, Recipe]] | None = None
    peft_task_type: str = "CAUSAL_LM"
    fan_in_fan_out: bool = False
    presets: tuple[str, ...] = ()
    not_loaded: Callable[[Fields, set[str]], dict[str, str]] | None = None

    def unread(self, model: Fields, tensor_names: set[str]) -> dict[str, str]:
        """{HF tensor: why} of the folder's tensors left unread on purpose (``not_loaded``; {} for most families)."""
        return self.not_loaded(model, tensor_names) if self.not_loaded else {}

    def accounted(self, model: Fields, tensor_names: set[str]) -> set[str]:
        """The HF tensors of a folder holding ``tensor_names`` that are read (the recipes') or left unread on
        purpose: any other is refused (``checkpoint/hf_files.check_all_read``)."""
        plan = self.read_plan(model, tensor_names)
        return {r.hf_name for r in plan.values()} | set(self.unread(model, tensor_names))

    def export_recipes(self, model: Fields) -> dict[str, Recipe]:
        """{our name: Recipe} under the names an export writes."""
        return self.write_plan(model) if self.write_plan else self.read_plan(model, set())

    def export_plan(self, model: Fields) -> dict[str, list[tuple[str, Recipe]]]:
        """{HF tensor name: [(our name, Recipe), ...]} of an export; a fused HF tensor lists each of its parts."""
        out: dict[str, list[tuple[str, Recipe]]] = {}
        for ours, recipe in self.export_recipes(model).items():
            out.setdefault(recipe.hf_name, []).append((ours, recipe))
        return out

    def export_config(self, model: Fields, dtype: str) -> dict[str, Any]:
        """config.json of an export of ``model`` in tensors of ``dtype`` (``float32``, ``bfloat16``, ...)."""
        return {"model_type": self.model_type, "architectures": [self.architecture],
                "vocab_size": model["vocab_size"], "torch_dtype": dtype,
                "tie_word_embeddings": bool(model["tie_embeddings"]), **self.to_hf(model, dtype)}
