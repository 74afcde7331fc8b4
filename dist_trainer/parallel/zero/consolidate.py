"""ZeRO checkpoints out of DeepSpeed's format: consolidated fp32 weights and AdamW moments, by parameter name.

A ZeRO step folder holds DeepSpeed's own files under ``deepspeed/`` (every rank's flat partitions).
``consolidate`` merges them with DeepSpeed's zero_to_fp32 reconstruction (deepspeed/utils/zero_to_fp32.py):
the fp32 master partitions for the weights, and the same reconstruction applied to the partitioned
``exp_avg``/``exp_avg_sq`` flat tensors (they share the master partitions' layout, padding included).
``checkpoint/convert.py`` reads the result by parameter name like any other checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def consolidate(ds_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(full fp32 model state dict, optimizer state by name) of DeepSpeed's checkpoint folder ``ds_dir``
    (the tag folder inside a step folder); plain model names."""
    from deepspeed.utils import zero_to_fp32 as z

    weights = z.get_fp32_state_dict_from_zero_checkpoint(str(ds_dir.parent), tag=ds_dir.name)
    model_state = {k: v.detach().clone().contiguous() for k, v in weights.items()}

    model_states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
    files = z.get_optim_files(str(ds_dir))
    # DeepSpeed's own pickles (they hold its config objects): trusted files this run wrote.
    raw = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    stage, world = raw[0]["zero_stage"], raw[0]["partition_count"]
    world = max(world) if isinstance(world, list) else world
    paddings = raw[0].get("param_alignment_paddings")
    # the wrapped torch AdamW over flat partitions: stage 3 saves it as optimizer_state_dict, stages 1-2 (without
    # elastic checkpoints) as base_optimizer_state (runtime/zero/stage_1_and_2.py state_dict)
    base = [r["optimizer_state_dict"] if "optimizer_state_dict" in r else r["base_optimizer_state"] for r in raw]
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
    return model_state, {"state": state}
