"""Export a checkpoint (any tp layout) as one plain model: safetensors weights + the model config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors.torch import save_file

from dist_trainer.checkpoint.weights import EXPORT_CONFIG, EXPORT_WEIGHTS
from dist_trainer.files import output_dir
from dist_trainer.model_lora import merge_adapters
from dist_trainer.train.generate import load_model_from_checkpoint


def export_safetensors(checkpoint: str | Path, out: str | Path, merge_lora: bool = False) -> Path:
    """Write ``out/model.safetensors`` (full fp32 tensors, plain parameter names) and ``out/config.json``.

    ``merge_lora``: fold a LoRA run's adapters into the weights they adapt, W = W0 + (alpha / r) B A (Hu et al.
    2021, section 4.1: no inference latency), and write a config without adapters: a plain model that computes
    what the adapted one does. Without it a LoRA run's adapters are exported under their own names.
    """
    out = output_dir(out, "--out")  # before the (long) load: a file or a read-only folder is named at once
    model, cfg = load_model_from_checkpoint(checkpoint)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    model_cfg = cfg.model
    if merge_lora:
        if not model_cfg.lora_rank:
            raise ValueError(f"--merge-lora: the checkpoint {checkpoint} has no LoRA adapters (model.lora_rank=0)")
        tensors = {k: v.contiguous() for k, v in merge_adapters(tensors, model_cfg.lora_scaling).items()}
        model_cfg = dataclasses.replace(model_cfg, lora_rank=0)
    save_file(tensors, str(out / EXPORT_WEIGHTS), metadata={"format": "pt", "producer": "dist_trainer"})
    (out / EXPORT_CONFIG).write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2, sort_keys=True))
    return out / EXPORT_WEIGHTS
