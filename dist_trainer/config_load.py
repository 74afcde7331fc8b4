"""Reading a run's config: YAML files, model presets, dotted CLI overrides, each value checked against its field.

Precedence is CLI > file > defaults (``load_config``). Every value is checked against the field's annotation
before the tree is built (``_coerce``: types, null, finite floats), so ``Config.validate`` sees typed values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from dist_trainer.config import PRESET_DIR, Config, ModelConfig
from dist_trainer.facts.hf_config import is_hf_folder, refuse_unreadable_config
from dist_trainer.files import read_text

# ModelConfig fields a run may set beside a Hugging Face folder's: they change no weight's name, shape or meaning
FREE_MODEL_FIELDS = ("preset", "dropout", "init_std", "scaled_residual_init", "lora_rank", "lora_alpha",
                     "lora_dropout", "lora_targets", "capacity_factor", "router_aux_loss", "router_z_loss",
                     "base_weight_dtype", "base_weight_group", "loss_chunk_tokens")


def hf_model_fields(path: str | Path) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face folder (or its config.json): its config, and its tensor names (which
    say whether a BERT folder has a pooler or a masked-LM head)."""
    from dist_trainer.facts.hf_config import read_hf_config
    from dist_trainer.families import family, model_fields

    folder = Path(path).parent if Path(path).name == "config.json" else Path(path)
    files = None
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        from dist_trainer.facts.hf_files import safetensors_index

        files = safetensors_index(folder)
    names = None if files is None else set(files)
    hf = read_hf_config(folder)
    where = str(folder / "config.json")
    fields = model_fields(hf, where, names)
    if files is not None:  # a tensor no parameter reads is refused here too: counts and plans hold every one
        from dist_trainer.facts.hf_files import check_all_read

        check_all_read(folder, files, family(hf.get("model_type"), where).accounted(fields, set(files)))
    return fields


# ...but a run that starts from a Hugging Face folder's weights has the folder's routing (Mixtral: dropless): a
# capacity below it drops tokens the folder's model never drops, so it is replaced like every field that changes the
# maths (a folder as a preset alone, weights drawn by the seed, keeps the run's capacity: a training choice there)
HF_FREE_MODEL_FIELDS = tuple(f for f in FREE_MODEL_FIELDS if f != "capacity_factor")


def _folder_implies(hf: dict[str, Any]) -> dict[str, Any]:
    """Every ModelConfig field a folder's model computes with: its mapped fields, ModelConfig's defaults for the
    rest (a family that maps no ``qk_norm`` computes without one, whatever a preset beside it says)."""
    defaults = {k: v for k, v in dataclasses.asdict(ModelConfig()).items() if k != "preset"}
    return {**defaults, **hf}


def _model_from_hf(model_fields: dict[str, Any], folder: str, preset: dict[str, Any] | None = None,
                   preset_name: str | None = None, free_fields: tuple[str, ...] = HF_FREE_MODEL_FIELDS
                   ) -> dict[str, Any]:
    """A run's model section when it starts from a Hugging Face folder: the folder's fields win over a preset's
    (``preset``, the fields of ``preset_name``) and over the run config's model section (``model_fields``), every
    replaced value named on stderr, so a run config written for another model still runs and computes exactly the
    folder's model. Only the run's own ``free_fields`` (dropout, LoRA, router loss weights, ...: no weight's
    meaning) are kept from the model section; a preset's are replaced where the folder sets them."""
    hf = hf_model_fields(folder)
    implied = _folder_implies(hf)
    replaced: dict[str, tuple[str, Any, Any]] = {}
    for source, fields, own in ((f"preset {preset_name}", preset or {}, False), ("run config", model_fields, True)):
        for k, v in fields.items():
            free = k in free_fields
            if k == "preset" or k not in implied or (free and (own or k not in hf)) or v == implied[k] or \
                    (not own and k in model_fields):  # the run config's value is the one the user wrote
                continue
            replaced[k] = (source, v, implied[k])
    if replaced:
        import sys

        print(f"note: the model comes from {folder}/config.json; these model fields are replaced by the folder's "
              f"(source: value -> folder's): " + ", ".join(f"{k}={a!r} ({s}) -> {b!r}"
                                                          for k, (s, a, b) in sorted(replaced.items())),
              file=sys.stderr)
    kept = {k: v for k, v in (preset or {}).items() if k in free_fields and k not in hf}
    kept.update({k: v for k, v in model_fields.items() if k in free_fields})
    return {**hf, **kept, "preset": folder}


def load_preset(name_or_path: str) -> dict[str, Any]:
    """The fields of a model preset: a name in configs/models/, a YAML path, or a Hugging Face folder (or its
    config.json), whose config is mapped by its family (``families/``)."""
    path = Path(name_or_path)
    if is_hf_folder(path):
        return hf_model_fields(path)
    refuse_unreadable_config(path)  # a config.json that is no model's is named as such, not as a missing preset
    if not path.suffix or (not path.is_file() and (PRESET_DIR / f"{name_or_path}.yaml").is_file()):
        path = PRESET_DIR / f"{name_or_path}.yaml"  # a preset name with a dot in it (a version number)
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ValueError(f"model preset {name_or_path!r} not found; known presets: {', '.join(known)}")
    data = parse_yaml(read_text(path, "a model preset is YAML text"), str(path)) or {}
    if not isinstance(data, dict):
        raise ValueError(f"model preset {path} must hold a mapping, got {type(data).__name__}")
    return data


def model_config(name_or_path: str, **overrides: Any) -> ModelConfig:
    """A validated ModelConfig from a preset name or YAML file, with field overrides."""
    given = {**load_preset(name_or_path), **overrides}
    cfg = _build(ModelConfig, given, "model")
    cfg.preset = name_or_path
    validate_naming_defaults(cfg, given, name_or_path)
    return cfg


def validate_naming_defaults(cfg: ModelConfig | Config, given: dict[str, Any], source: str) -> None:
    """``cfg.validate()`` (a model section, or a whole config), whose error also says which of the model values it
    names were not in ``source`` but filled from ModelConfig's defaults (issue 28: a YAML without n_heads was refused
    naming n_heads=12, never written)."""
    model = cfg.model if isinstance(cfg, Config) else cfg
    try:
        cfg.validate()
    except ValueError as exc:
        defaulted = [f"{f.name}={getattr(model, f.name)!r}" for f in dataclasses.fields(ModelConfig)
                     if f.name not in given and f.name != "preset" and re.search(rf"\b{f.name}\b", str(exc))]
        if not defaulted:
            raise
        raise ValueError(f"{exc} ({', '.join(defaulted)}: not given in {source}, the default)") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults < YAML file < dotted CLI overrides (``model.n_layers=4``), validated (``Config.validate``: the one
    validation of a launch; the trainer's pre-launch check takes the config as validated)."""
    tree: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(f"config file {path} {'is not a file' if Path(path).exists() else 'does not exist'}")
        tree = parse_yaml(read_text(Path(path), "a run config is YAML text"), str(path)) or {}
        if not isinstance(tree, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections")
    for item in overrides or []:
        key, value = parse_override(item)
        section, _, name = key.partition(".")
        if not name:
            raise ValueError(f"override {item!r} must be dotted: section.field=value")
        tree.setdefault(section, {})
        if not isinstance(tree[section], dict):
            raise ValueError(f"config section {section!r} must be a mapping")
        tree[section][name] = value
    cfg = config_from_dict(tree)
    model: dict[str, Any] = tree["model"] if isinstance(tree.get("model"), dict) else {}
    if model.get("preset"):  # a preset's fields are the preset's
        cfg.validate()
    else:  # the model section is the user's: an error names the model fields it left to their defaults
        validate_naming_defaults(cfg, model, f"the model section of {path or 'the overrides'}")
    return cfg


def config_from_dict(tree: dict[str, Any]) -> Config:
    sections = {f.name: typing.cast(type, f.default_factory) for f in dataclasses.fields(Config)}
    unknown = set(tree) - set(sections)
    if unknown:
        raise ValueError(f"unknown config sections {sorted(unknown)}; valid: {sorted(sections)}")
    model_fields = dict(tree.get("model") or {})
    init_from = (tree.get("train") or {}).get("init_from")
    if isinstance(init_from, str):
        refuse_unreadable_config(init_from)
    if isinstance(init_from, str) and is_hf_folder(init_from):  # the model is the folder's (issue 21)
        preset = model_fields.get("preset")
        model_fields = _model_from_hf({k: v for k, v in model_fields.items() if k != "preset"}, init_from,
                                      load_preset(str(preset)) if preset else None, preset)
    elif model_fields.get("preset") and is_hf_folder(str(model_fields["preset"])):
        model_fields = _model_from_hf({k: v for k, v in model_fields.items() if k != "preset"},
                                      str(model_fields["preset"]), free_fields=FREE_MODEL_FIELDS)
    elif model_fields.get("preset"):
        model_fields = {**load_preset(model_fields["preset"]), **model_fields}
    built = {}
    for name, cls in sections.items():
        fields = model_fields if name == "model" else (tree.get(name) or {})
        built[name] = _build(cls, fields, name)
    return Config(**built)


def parse_override(item: str) -> tuple[str, Any]:
    """``--model.n_layers=4`` or ``model.n_layers=4`` -> ("model.n_layers", 4); YAML typing."""
    item = item[2:] if item.startswith("--") else item
    key, sep, raw = item.partition("=")
    if not sep:
        raise ValueError(f"override {item!r} must look like section.field=value")
    if raw.startswith("*"):  # a glob (--train.freeze=*.attn_norm), not a YAML alias: no anchor exists in one value
        return key, raw
    return key, parse_yaml(raw, f"override {item!r}") if raw != "" else None


# values a YAML document may expand to through its aliases (a run config holds hundreds): a few hundred bytes of
# nested anchors (`&a [*b, *b, ...]`) expand to billions, which a walk over the config (train.freeze) or an error
# quoting it never finishes (issue 40)
MAX_YAML_VALUES = 100_000


def _expanded_values(node: Any, memo: dict[int, int], active: set[int]) -> int:
    """Values ``node`` holds once its aliases are expanded, each shared container counted once per use (memoised:
    linear in the document's size); ValueError for a container that holds itself."""
    if not isinstance(node, dict | list):
        return 1
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise ValueError("an alias refers to a mapping or list that holds it")
    active.add(key)
    children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
    memo[key] = total = 1 + sum(_expanded_values(c, memo, active) for c in children)
    active.discard(key)
    return total


def parse_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load``; a syntax error becomes a ValueError naming ``source`` and the line, not
    PyYAML's ``<unicode string>``; a document whose aliases expand beyond ``MAX_YAML_VALUES`` values is refused."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and start is not None and start.line != getattr(mark, "line", None):
            problem += f" ({context} that starts at line {start.line + 1})"  # where the typo usually is
        raise ValueError(f"{source}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise ValueError(f"{source}: invalid YAML: nested too deeply") from None
    try:
        values = _expanded_values(data, {}, set())
    except RecursionError:
        raise ValueError(f"{source}: invalid YAML: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if values > MAX_YAML_VALUES:
        raise ValueError(f"{source}: its aliases (*name) expand it to {values:,} values, beyond the "
                         f"{MAX_YAML_VALUES:,} a config may hold: write the values out, or use fewer nested aliases")
    return data


@functools.cache
def _field_hints(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """(annotation per field, field names) of a config dataclass: resolved once (the planner builds many configs)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls))


def _build(cls: type, fields: dict[str, Any], section: str) -> Any:
    hints, valid = _field_hints(cls)
    unknown = set(fields) - valid
    if unknown:
        raise ValueError(f"unknown {section} fields {sorted(unknown)}; valid: {sorted(valid)}")
    return cls(**{k: _coerce(v, hints[k], f"{section}.{k}") for k, v in fields.items()})


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Check a YAML value against the field's annotation (ints may stand for floats)."""
    # the members of a union (X | None); a generic's own arguments (list[str]) are not alternatives
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
        return None  # YAML reads ``none`` as a string; an optional field takes it as null (capacity_factor: none)
    if value is None:
        if type(None) in args:
            return None
        raise ValueError(f"{name} may not be null")
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if base is float and isinstance(value, str):
        try:
            value = float(value)  # YAML reads "3e-4" (and "inf", "nan", "1e400") as a string
        except ValueError:
            pass
    if base in (int, float, str, bool) and (not isinstance(value, base) or
                                            (base is int and isinstance(value, bool))):
        raise ValueError(f"{name}={value!r} must be of type {base.__name__}")
    # inf or nan passes every range check (nan compares false): an lr of inf trained to exit 0 (issue 16)
    if base is float and not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    return value
