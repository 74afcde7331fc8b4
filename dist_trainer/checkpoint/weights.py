"""The weights a run starts from (``train.init_from``): a checkpoint of any layout, or an export, by parameter name.

Fine-tuning starts from a trained model rather than the seed's draw. The source is

- a checkpoint: a run folder, its ``checkpoints/`` or one step folder, saved under any tp x pp layout or by
  ZeRO (``convert.read_full_state`` merges every shard into full tensors by name), or
- an export: a folder holding ``model.safetensors`` (and ``config.json``), or the ``.safetensors`` file itself.

Adapters in the source are folded into its base weights (``model_lora.merge_adapters``): "the base" is what
the source model computes. The run's own adapters keep their fresh draw (B = 0, so step 0 computes exactly
the source model). Only the optimizer-free weights are read: the run starts at step 0 with a fresh optimizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dist_trainer.checkpoint.convert import read_full_state
from dist_trainer.checkpoint.publish import read_meta, resolve_checkpoint
from dist_trainer.config import ModelConfig
from dist_trainer.model_lora import is_adapter, merge_adapters

EXPORT_WEIGHTS = "model.safetensors"  # what train/export.py writes
EXPORT_CONFIG = "config.json"
# ModelConfig fields a fine-tuning run may set differently from its source: they change no base weight's
# name, shape or meaning
FREE_FIELDS = ("preset", "dropout", "init_std", "scaled_residual_init", "lora_rank", "lora_alpha", "lora_dropout",
               "lora_targets")

Gather = Callable[[list[nn.Parameter]], AbstractContextManager]


def _export_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".safetensors":
        return path
    return path / EXPORT_WEIGHTS if (path / EXPORT_WEIGHTS).is_file() else None


def source_model_config(path: str | Path) -> dict[str, Any] | None:
    """The source's model config fields (meta.json's or the export's config.json); None for a bare safetensors
    file. ValueError when ``path`` holds neither a checkpoint nor an export."""
    p = Path(path)
    export = _export_file(p)
    if export is not None:
        config = export.parent / EXPORT_CONFIG
        return json.loads(config.read_text()) if config.is_file() else None
    try:
        return read_meta(resolve_checkpoint(p))["config"]["model"]
    except ValueError:
        raise ValueError(f"train.init_from={path}: neither a checkpoint (run folder, checkpoints/ or step folder) nor "
                         f"an export ({EXPORT_WEIGHTS}) is there") from None


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


def read_start_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The source's full tensors by plain parameter name, adapters merged into their base weights."""
    p = Path(path)
    export = _export_file(p)
    if export is not None:
        from safetensors.torch import load_file

        state = load_file(str(export))
        source = source_model_config(p) or {}
    else:
        step = resolve_checkpoint(p)
        meta = read_meta(step)
        state, _ = read_full_state(step, meta)
        source = meta["config"]["model"]
    if source.get("lora_rank"):
        state = merge_adapters(state, source["lora_alpha"] / source["lora_rank"])
    return state


def copy_start_weights_(model: nn.Module, state: dict[str, torch.Tensor], gathered: Gather | None = None) -> None:
    """Every base parameter of ``model`` (plain names and shapes) from ``state``; adapters keep their draw.

    ``gathered``: a context that makes a module's own parameters whole for the copy (ZeRO-3's
    ``GatheredParameters``). ``model`` may be a part of the source's model (a pipeline rank's stages); ValueError
    naming the parameters that are missing or of another shape.
    """
    own = {n: p for n, p in model.named_parameters() if not is_adapter(n)}
    shape = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in own.items()}
    missing = sorted(set(own) - set(state))
    wrong = [(n, tuple(state[n].shape), shape[n]) for n in sorted(set(own) & set(state))
             if tuple(state[n].shape) != shape[n]]
    if missing or wrong:
        raise ValueError(f"train.init_from: the source's weights do not fit this model: missing {missing[:5]}, "
                         f"other shapes (source, model) {wrong[:5]}")
    with torch.no_grad():
        for prefix, module in model.named_modules():
            params = [(f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False)]
            params = [(n, p) for n, p in params if n in own]
            if not params:
                continue
            with (gathered or (lambda _: nullcontext()))([p for _, p in params]):
                for n, p in params:
                    p.copy_(state[n].to(p.dtype))
