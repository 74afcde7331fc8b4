"""Export a checkpoint (any layout), a native export or a Hugging Face folder as one plain model.

``--format hf`` (the default) writes a Hugging Face folder tensor by tensor (``checkpoint/hf_export.py``);
``--format native`` this project's ``model.safetensors`` under its own names with its ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dist_trainer.checkpoint.hf_config import is_hf_folder
from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.checkpoint.weights import EXPORT_CONFIG, EXPORT_WEIGHTS
from dist_trainer.files import atomic_write_text, output_dir, refuse_nonempty, write_safetensors
from dist_trainer.model_lora import merge_adapters


def export_safetensors(checkpoint: str | Path, out: str | Path, merge_lora: bool = False) -> Path:
    """Write ``out/model.safetensors`` (full fp32 tensors, plain parameter names) and ``out/config.json``.

    ``merge_lora``: fold a LoRA run's adapters into the weights they adapt, W = W0 + (alpha / r) B A (Hu et al.
    2021, section 4.1: no inference latency), and write a config without adapters: a plain model that computes
    what the adapted one does. Without it a LoRA run's adapters are exported under their own names.
    """
    out = output_dir(out, "--out")  # before the (long) load: a file or a read-only folder is named at once
    model, cfg = load_plain_model(checkpoint)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    model_cfg = cfg.model
    if merge_lora:
        if not model_cfg.lora_rank:
            raise ValueError(f"--merge-lora: the checkpoint {checkpoint} has no LoRA adapters (model.lora_rank=0)")
        tensors = {k: v.contiguous() for k, v in merge_adapters(tensors, model_cfg.lora_scaling).items()}
        model_cfg = dataclasses.replace(model_cfg, lora_rank=0)
    write_safetensors(tensors, out / EXPORT_WEIGHTS, metadata={"format": "pt", "producer": "dist_trainer"})
    atomic_write_text(out / EXPORT_CONFIG, json.dumps(dataclasses.asdict(model_cfg), indent=2, sort_keys=True))
    return out / EXPORT_WEIGHTS


FORMATS = ("hf", "native")


def export_checkpoint(checkpoint: str | Path, out: str | Path, fmt: str = "hf", dtype: str = "fp32",
                      max_shard_size: str = "5GB", merge_lora: bool = False, adapter: bool = False,
                      force: bool = False) -> list[Path]:
    """``dist-trainer export``: the files written. ``hf``: a Hugging Face folder (a LoRA run's adapters folded in,
    or with ``adapter`` a PEFT adapter folder alone); ``native``: ``export_safetensors``. A non-empty ``out`` is
    refused unless ``force`` (nothing of the user's is replaced silently), before any work."""
    from dist_trainer.checkpoint.checkpoint_source import CheckpointSource
    from dist_trainer.checkpoint.hf_export import export_hf, export_peft_adapter
    from dist_trainer.checkpoint.source import open_source

    if fmt not in FORMATS:
        raise ValueError(f"--format={fmt!r} is not one of {', '.join(FORMATS)}")
    refuse_nonempty(out, force)
    if fmt == "native":
        if adapter or dtype != "fp32":
            raise ValueError("--adapter and --dtype are options of --format hf")
        return [export_safetensors(checkpoint, out, merge_lora=merge_lora)]
    out = output_dir(out, "--out")
    source = open_source(checkpoint)
    if isinstance(source, CheckpointSource):
        model, config = dict(source.model), source.meta["config"]
        dirs = [Path(p) for p in (config.get("data", {}).get("path"), config.get("train", {}).get("init_from"))
                if isinstance(p, str)]
        if adapter:
            return export_peft_adapter(source, model, out, config.get("train", {}).get("init_from"), dtype)
        model["lora_rank"] = 0  # the source folds the adapters into their weights
    else:
        if adapter:
            raise ValueError(f"--adapter: {checkpoint} is no LoRA checkpoint")
        from dist_trainer.checkpoint.plain import export_model_fields

        model = export_model_fields(checkpoint)
        dirs = [Path(checkpoint)] if is_hf_folder(checkpoint) else []
    return export_hf(source, model, out, dtype, max_shard_size, dirs)
