"""The weights a run starts from (``train.init_from``), checked before any process group.

The source is a Hugging Face folder, a checkpoint (run folder, its ``checkpoints/`` or one step folder, any
layout, ZeRO too) or a native export (a folder holding ``model.safetensors`` and ``config.json``, or the
``.safetensors`` file itself); ``source.open_source`` reads it and ``load.load_owned_`` copies each rank's slices.
Adapters in the source are folded into its base weights: "the base" is what the source model computes. The run's
own adapters keep their fresh draw (B = 0, so step 0 computes exactly the source model). Only the optimizer-free
weights are read: the run starts at step 0 with a fresh optimizer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dist_trainer.checkpoint.publish import read_meta, resolve_checkpoint
from dist_trainer.config import ModelConfig
from dist_trainer.config_load import FREE_MODEL_FIELDS
from dist_trainer.facts.hf_config import is_hf_folder

EXPORT_WEIGHTS = "model.safetensors"  # what train/export.py writes
EXPORT_CONFIG = "config.json"
# ModelConfig fields a fine-tuning run may set differently from its source (they change no base weight's name,
# shape or meaning): config_load's, which a run from a Hugging Face folder keeps too
FREE_FIELDS = FREE_MODEL_FIELDS


def _export_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".safetensors":
        return path
    return path / EXPORT_WEIGHTS if (path / EXPORT_WEIGHTS).is_file() else None


def source_model_config(path: str | Path) -> dict[str, Any] | None:
    """The source's model config fields (meta.json's or the export's config.json); None for a bare safetensors
    file. ValueError when ``path`` holds neither a checkpoint nor an export."""
    p = Path(path)
    if is_hf_folder(p):
        from dist_trainer.config_load import hf_model_fields

        return hf_model_fields(p)
    export = _export_file(p)
    if export is not None:
        config = export.parent / EXPORT_CONFIG
        return json.loads(config.read_text()) if config.is_file() else None
    try:
        return read_meta(resolve_checkpoint(p))["config"]["model"]
    except ValueError:
        raise ValueError(f"train.init_from={path}: neither a checkpoint (run folder, checkpoints/ or step folder), "
                         f"an export ({EXPORT_WEIGHTS}) nor a Hugging Face folder (config.json) is there") from None


def check_start_weights(path: str | Path, model: ModelConfig) -> None:
    """Before any process group: ``path`` holds weights, and their model is this run's but for fine-tuning fields."""
    source = source_model_config(path)
    if source is None:
        return  # a bare .safetensors file: names and shapes are checked when it is read
    now = dataclasses.asdict(model)
    diff = {k: (source[k], v) for k, v in now.items() if k not in FREE_FIELDS and k in source and source[k] != v}
    if diff:
        raise ValueError(f"train.init_from={path}: its model differs from this run's (source, now): {diff}; only "
                         f"{', '.join(FREE_FIELDS)} may change when starting from other weights")
