"""Export a checkpoint (any tp layout) as one plain model: safetensors weights + the model config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors.torch import save_file

from dist_trainer.files import output_dir
from dist_trainer.train.generate import load_model_from_checkpoint


def export_safetensors(checkpoint: str | Path, out: str | Path) -> Path:
    """Write ``out/model.safetensors`` (full fp32 tensors, plain parameter names) and ``out/config.json``."""
    out = output_dir(out, "--out")  # before the (long) load: a file or a read-only folder is named at once
    model, cfg = load_model_from_checkpoint(checkpoint)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "producer": "dist_trainer"})
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg.model), indent=2, sort_keys=True))
    return out / "model.safetensors"
