"""Any saved model as one plain ``Transformer``: a checkpoint of any layout, a native export or a Hugging Face
folder (what ``generate``, ``export`` and ``attention`` read)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.checkpoint_source import load_shards
from dist_trainer.checkpoint.convert import check_files
from dist_trainer.checkpoint.load import load_owned_
from dist_trainer.checkpoint.publish import read_meta, resolve_checkpoint
from dist_trainer.checkpoint.source import open_source
from dist_trainer.checkpoint.weights import EXPORT_CONFIG, EXPORT_WEIGHTS
from dist_trainer.config import Config
from dist_trainer.config_load import config_from_dict, hf_model_fields
from dist_trainer.facts.hf_config import is_hf_folder, refuse_unreadable_config
from dist_trainer.facts.quant_sizes import int8_modules
from dist_trainer.files import refuse_host_shortfall
from dist_trainer.model import Transformer, build_model
from dist_trainer.parallel.tp.reshard import ShardSpec, tp_shard_specs
from dist_trainer.planner.params import param_breakdown
from dist_trainer.quant.int8 import dequantize_state


def _empty_model(cfg: Config, where: Path) -> Transformer:
    """The model, its weights still to be read; refused first where this node's host memory cannot hold it (and,
    from a checkpoint, the merged state beside it)."""
    n_params = param_breakdown(cfg.model).total
    copies = 1 if is_hf_folder(where) or where.suffix == ".safetensors" or (where / EXPORT_WEIGHTS).is_file() else 2
    refuse_host_shortfall(copies * n_params * 4, f"{where}: its model as one fp32 copy ({n_params:,} parameters x 4 "
                          f"bytes{', and the state read from its shards beside it' if copies == 2 else ''}) needs",
                          "read it on a machine with more memory (generate, export and eval hold the whole model)")
    model = build_model(cfg.model, device="meta")
    model.to_empty(device="cpu")
    model.reset_parameters()  # the position tables and the adapters' draw; every weight is then overwritten
    return model


def export_model_fields(path: str | Path) -> dict[str, Any]:
    """Every ModelConfig field of an HF folder or a native export (its config.json; the rest defaults)."""
    p = Path(path)
    if is_hf_folder(p):
        fields = hf_model_fields(p)
    else:
        config = (p if p.is_dir() else p.parent) / EXPORT_CONFIG
        if not config.is_file():
            raise ValueError(f"{p}: an export needs its {EXPORT_CONFIG} beside {EXPORT_WEIGHTS}")
        fields = json.loads(config.read_text())
    return dataclasses.asdict(config_from_dict({"model": {**fields, "preset": None}}).model)


def load_plain_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[Transformer, Config]:
    """The plain model at ``path`` and its run config (a Hugging Face folder or an export: the model section
    alone, every other section default): an HF folder (``config.json`` + safetensors), a native export
    (``model.safetensors`` + ``config.json``), or a checkpoint (run folder, checkpoints/ or step folder)."""
    p = Path(path)
    if is_hf_folder(p) or (p / EXPORT_WEIGHTS).is_file() or (p.is_file() and p.suffix == ".safetensors"):
        # the folder's files, names and shapes checked against its config before the model is built (a config of
        # 200,000 layers over the weights of 2 was refused only after minutes of building)
        source = open_source(p)
        cfg = config_from_dict({"model": export_model_fields(p)})
        model = _empty_model(cfg, p)
        unused = sorted(source.names() - set(model.state_dict()))  # a native export's: its config is the model's
        if unused:
            raise ValueError(f"{source.where}: holds tensors this model does not use: {', '.join(unused[:6])}"
                             + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
                             + " (they would be ignored; export the model again, or remove them)")
        load_owned_(model, source, what="--checkpoint")
        return model.to(device).eval(), cfg
    refuse_unreadable_config(p)  # a folder whose config.json is broken is named as such, not as a checkpoint
    step_path = resolve_checkpoint(p)
    meta = read_meta(step_path)
    check_files(step_path, meta)  # every file read weights-only first: a bad one is named, nothing executed
    cfg = config_from_dict(meta["config"])
    model = _empty_model(cfg, p)
    # every tp x pp shard merged by name (a ZeRO checkpoint: DeepSpeed's partitions consolidated to fp32)
    specs = tp_shard_specs(model)  # and the scales of an int8-base run's weights, whole (parallel/int8.py)
    specs.update({f"{n}.weight_scale": ShardSpec(None, None) for n in int8_modules(cfg.model, cfg.train.freeze)})
    state, _ = load_shards(step_path, meta, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, specs_now=specs)
    model.load_state_dict(dequantize_state(state))  # an int8-base run's frozen linears as fp32 weights
    return model.to(device).eval(), cfg
