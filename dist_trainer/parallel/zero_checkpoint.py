"""ZeRO checkpoints out of DeepSpeed's format: consolidated fp32 weights and AdamW moments, by parameter name.

A ZeRO step folder holds DeepSpeed's own files under ``deepspeed/`` (every rank's flat partitions).
``consolidate`` merges them with DeepSpeed's zero_to_fp32 reconstruction (deepspeed/utils/zero_to_fp32.py):
the fp32 master partitions for the weights, and the same reconstruction applied to the partitioned
``exp_avg``/``exp_avg_sq`` flat tensors (they share the master partitions' layout, padding included).
``export_single_process`` writes the result as this project's checkpoint (model_tp00_pp00.pt,
optim_tp00_pp00.pt, meta.json), which the DDP/TP trainer resumes at any tp size.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from dist_trainer.train import checkpoint as ckpt

MOMENTS = ("exp_avg", "exp_avg_sq")


def _ds_dir(step_dir: Path, meta: dict[str, Any]) -> Path:
    tag = meta.get("deepspeed_tag")
    if tag is None:
        raise ValueError(f"checkpoint {step_dir} was written by the {meta.get('regime')!r} regime, not ZeRO")
    return step_dir / tag


def consolidate(step_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(full fp32 model state dict, optimizer state by name) of a ZeRO step folder; plain model names."""
    from deepspeed.utils import zero_to_fp32 as z

    meta = ckpt.read_meta(step_dir)
    ds_dir = _ds_dir(step_dir, meta)
    weights = z.get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=ds_dir.name)
    model_state = {k: v.detach().clone().contiguous() for k, v in weights.items()}

    model_states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
    files = z.get_optim_files(str(ds_dir))
    # DeepSpeed's own pickles (they hold its config objects): trusted files this run wrote.
    raw = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    stage, world = raw[0]["zero_stage"], raw[0]["partition_count"]
    world = max(world) if isinstance(world, list) else world
    paddings = raw[0].get("param_alignment_paddings")
    base = [r["optimizer_state_dict"] for r in raw]  # the wrapped torch AdamW over flat partitions
    per_moment: dict[str, dict[str, torch.Tensor]] = {}
    for key in MOMENTS:
        flat = [[b["state"][g][key] for g in sorted(b["state"])] for b in base]
        if stage <= 2:
            merged = z._get_fp32_state_dict_from_zero2_checkpoint(world, flat, model_states, False, paddings)
        else:
            merged = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat, model_states, False)
        per_moment[key] = z.to_torch_tensor(merged)  # stage 3 returns lazy GatheredTensors
    trainable = {n for shapes in model_states[0].param_shapes for n in shapes}
    step = base[0]["state"][min(base[0]["state"])]["step"]
    state = {n: {"step": step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step)),
                 **{k: per_moment[k][n].clone().contiguous() for k in MOMENTS}} for n in sorted(trainable)}
    return model_state, {"state": state, "meta": meta}


def export_single_process(step_dir: Path, out_dir: Path) -> Path:
    """Write a ZeRO checkpoint as a single-process checkpoint under ``out_dir/checkpoints``; return its folder.

    The AdamW groups are rebuilt by name from the model (train.optim.param_groups), so the result loads with
    ``train.resume`` into a DDP/TP run; the data position and config are the ZeRO run's.
    """
    from dist_trainer.config import config_from_dict
    from dist_trainer.model import build_model
    from dist_trainer.parallel.reshard import tp_shard_specs
    from dist_trainer.train.optim import build_optimizer

    model_state, optim = consolidate(step_dir)
    meta = optim.pop("meta")
    cfg = config_from_dict(meta["config"])
    model = build_model(cfg.model, device="meta")
    missing = set(model.state_dict()) - set(model_state)
    if missing:
        raise ValueError(f"ZeRO checkpoint {step_dir} lacks parameters {sorted(missing)[:5]}")
    # The groups (hyper-parameters, decay membership) of the optimizer the DDP/TP engine builds, by name.
    groups = ckpt.optimizer_state_by_name(model, build_optimizer(model, cfg.optim))["param_groups"]
    optim_state = {"state": optim["state"], "param_groups": groups}
    layout = {"tp": 1, "pp": 1, "dp": 1, "world": 1}
    def write(folder: Path) -> dict[str, Any]:
        ckpt.atomic_save({k: model_state[k] for k in model.state_dict()}, folder / ckpt.shard_name("model", 0, 0))
        ckpt.atomic_save(optim_state, folder / ckpt.shard_name("optim", 0, 0))
        ckpt.write_specs(folder, 0, tp_shard_specs(model))  # so another tp x pp layout can reshard it
        return {}

    new_meta = {"config": meta["config"], "layout": layout, "data": meta["data"],
                "regime": "single", "exported_from": meta.get("regime")}
    final = ckpt.save_checkpoint(Path(out_dir) / "checkpoints", int(meta["step"]), rank=0, write_shards=write,
                                 meta=new_meta, barrier=lambda: None, keep=1)
    # Dropout stream of dp rank 0 (the single process's is the same seed + 1 + 0): not this exporter's RNG.
    rng = step_dir / "rng_rank00000.pt"
    if rng.is_file():
        shutil.copyfile(rng, final / "rng_rank00000.pt")
    return final
