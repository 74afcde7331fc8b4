"""DeepSpeed's ZeRO checkpoint files, read safely and consolidated by parameter name per (tp, pp) coordinate.

A ZeRO step folder holds DeepSpeed's own files under its tag folder (``deepspeed/``), one set per model-parallel
rank ``M = pp_rank * tp_size + tp_rank`` (``parallel/zero/deepspeed.DeepSpeedMpu``), i.e. per (tp, pp)
coordinate, each split over the dp ranks ``D``::

    mp_rank_MM_model_states.pt                    ZeRO-1/2: the module's weights, param_shapes (dp rank 0 writes)
    zero_pp_rank_D_mp_rank_MM_model_states.pt     ZeRO-3: param_shapes (every dp rank writes; weights partitioned)
    [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   dp rank D's flat fp32 master partition and AdamW moments

Every file is read with ``torch.load(weights_only=True)`` (``publish.load_file``), allowing only the DeepSpeed
classes these files hold (``deepspeed_safe_types``); DeepSpeed's own readers (``zero_to_fp32``,
``engine.load_checkpoint``) unpickle with ``weights_only=False`` and are never called.

``consolidate`` rebuilds one coordinate's full fp32 weights (the master partitions, not the 16-bit module) and
AdamW moments by parameter name, as DeepSpeed's zero_to_fp32.py does for the weights (deepspeed/utils/
zero_to_fp32.py, _zero2_merge_trainable_params / _zero3_merge_trainable_params):

- ZeRO-1/2: a parameter group's flat vector is the dp ranks' partitions end to end (saved without the group's
  end padding), parameters in ``param_shapes`` order, each followed by its alignment padding; the moments share
  the layout, with the group padding still at the end of the last rank's.
- ZeRO-3: each parameter is cut into dp pieces of ceil(n / dp) elements (the last zero-padded), and rank D's
  flat groups hold its piece of every parameter in ``param_shapes`` order.

``checkpoint/convert.py`` merges the coordinates over TP with the saved ``tp_specs_ppPP.json`` like any other
checkpoint's shards.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.publish import load_file
from dist_trainer.optim_lowbit import canonical_state


def deepspeed_safe_types() -> list[type]:
    """The classes DeepSpeed 0.19.8 pickles into its checkpoint files (read off ``get_unsafe_globals_in_checkpoint``
    of ZeRO-1/2/3 and offload checkpoints; DynamicLossScaler for fp16): plain data holders."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


def load_deepspeed_file(path: Path, mmap: bool = False) -> Any:
    return load_file(path, safe_types=deepspeed_safe_types(), mmap=mmap)


def mp_rank(tp_rank: int, pp_rank: int, tp_size: int) -> int:
    """DeepSpeed's model-parallel rank of a (tp, pp) coordinate (``DeepSpeedMpu.get_model_parallel_rank``)."""
    return pp_rank * tp_size + tp_rank


def optim_file(ds_dir: Path, dp_rank: int, mp: int) -> Path:
    """dp rank ``dp_rank``'s optimizer partition of coordinate ``mp`` (``bf16_``-prefixed in bf16 runs)."""
    name = f"zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_optim_states.pt"
    bf16 = ds_dir / f"bf16_{name}"
    return bf16 if bf16.is_file() else ds_dir / name


def model_file(ds_dir: Path, mp: int, stage: int, dp_rank: int = 0) -> Path:
    prefix = f"zero_pp_rank_{dp_rank}_" if stage == 3 else ""
    return ds_dir / f"{prefix}mp_rank_{mp:02d}_model_states.pt"


def read_partitions(ds_dir: Path, mp: int, dp_size: int, stage: int,
                    mmap: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(dp rank 0's model-states dict, every dp rank's ZeRO optimizer state dict) of coordinate ``mp``."""
    model_states = load_deepspeed_file(model_file(ds_dir, mp, stage), mmap=mmap)
    optims = [load_deepspeed_file(optim_file(ds_dir, d, mp), mmap=mmap) for d in range(dp_size)]
    return model_states, [o["optimizer_state_dict"] for o in optims]


def _base_state(sd: dict[str, Any], stage: int) -> list[dict[str, Any]]:
    """Per flat group (ZeRO-1/2 parameter group, ZeRO-3 sub-group), the wrapped AdamW's state, its moments in fp32
    whatever ``optim.state_dtype`` stored them in (``optim_lowbit.canonical_state``; before the padding is cut, as
    an int8 state's block scales are not per element)."""
    if stage == 3:
        state = sd["optimizer_state_dict"]["state"]
        return [canonical_state(state[k]) for k in sorted(state)]
    base = sd["base_optimizer_state"]
    if isinstance(base, list):  # an elastic checkpoint: group states already stripped of their padding
        step = sd.get("base_optimizer_state_step")
        return [canonical_state({**g, **({"step": step} if step is not None and "step" not in g else {})})
                for g in base]
    state = base["state"]
    return [{k: _strip(v, sd["group_paddings"][i]) for k, v in canonical_state(state[g]).items()}
            for i, g in enumerate(sorted(state))]


def _strip(value: Any, padding: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim == 1 and padding:
        return value[: value.numel() - padding]
    return value


def _zero12_split(flats: list[torch.Tensor], shapes: dict[str, torch.Size],
                  paddings: list[int] | None) -> dict[str, torch.Tensor]:
    """One ZeRO-1/2 parameter group: dp ranks' unpadded partitions end to end -> tensors by name."""
    full = torch.cat([f.reshape(-1) for f in flats])
    out, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)
        out[name] = full.narrow(0, offset, n).view(shape).clone()
        offset += n + (paddings[i] if paddings else 0)
    if offset > full.numel():
        raise ValueError(f"ZeRO partitions hold {full.numel()} elements, the parameters need {offset}")
    return out


def _zero3_split(flats: list[torch.Tensor], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """ZeRO-3: every dp rank's flat partition (its sub-groups end to end) -> tensors by name."""
    world = len(flats)
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        piece = math.ceil(n / world)
        out[name] = torch.cat([f.narrow(0, offset, piece) for f in flats]).narrow(0, 0, n).view(shape).clone()
        offset += piece
    if offset != flats[0].numel():
        raise ValueError(f"ZeRO-3 partitions hold {flats[0].numel()} elements per rank, the parameters {offset}")
    return out


def _group_by_name(flats: list[torch.Tensor], stage: int, shapes: dict[str, torch.Size],
                   paddings: list[int] | None) -> dict[str, torch.Tensor]:
    """One flat group's (ZeRO-1/2 parameter group, ZeRO-3 sub-group) dp partitions -> tensors by name."""
    return _zero3_split(flats, shapes) if stage == 3 else _zero12_split(flats, shapes, paddings)


def _by_name(per_rank_groups: list[list[torch.Tensor]], stage: int, shapes: list[dict[str, torch.Size]],
             paddings: list[list[int]] | None) -> dict[str, torch.Tensor]:
    """Per dp rank, its flat tensors per group -> full tensors by parameter name."""
    out: dict[str, torch.Tensor] = {}
    for g, group_shapes in enumerate(shapes):
        out.update(_group_by_name([groups[g] for groups in per_rank_groups], stage, group_shapes,
                                  None if paddings is None else paddings[g]))
    return out


def consolidate(ds_dir: Path, mp: int, dp_size: int,
                stage: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(fp32 weights, {"state": AdamW state}) by parameter name of coordinate ``mp`` of a ZeRO checkpoint.

    Parameters without optimizer state (frozen) come from the module's saved weights (ZeRO-1/2) or DeepSpeed's
    frozen fragments (ZeRO-3)."""
    model_states, optims = read_partitions(ds_dir, mp, dp_size, stage)
    shapes = model_states["param_shapes"]
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    paddings = optims[0].get("param_alignment_paddings")
    weights = _by_name([o[key] for o in optims], stage, shapes, paddings)
    bases = [_base_state(o, stage) for o in optims]
    # the optimizer's step count: the groups that count steps hold it (a momentum's, Muon's, counts none)
    step = torch.tensor(max(float(g.get("step", 0)) for g in bases[0]))
    state: dict[str, dict[str, Any]] = {n: {"step": step.clone()} for n in weights}
    # the state tensors each flat group's optimizer saved (its entry's ``states``: AdamW's moments, a momentum
    # buffer; an entry and its fallback keep different ones), by name; ZeRO-3's flat groups are its sub-groups,
    # in param_shapes' order as in the optimizer's state
    for g, group_shapes in enumerate(shapes):
        for k in (k for k in bases[0][g] if k != "step"):
            split = _group_by_name([b[g][k] for b in bases], stage, group_shapes,
                                   None if paddings is None else paddings[g])
            for n, t in split.items():
                state[n][k] = t
    frozen = model_states.get("frozen_param_shapes") or {}
    if frozen:
        if stage == 3:
            fragments = [load_deepspeed_file(model_file(ds_dir, mp, stage, d))["frozen_param_fragments"]
                         for d in range(dp_size)]
            weights.update({n: torch.cat([f[n].reshape(-1) for f in fragments]).narrow(0, 0, math.prod(s)).view(s)
                            for n, s in frozen.items()})
        else:
            weights.update({n: model_states["module"][n].float() for n in frozen})
    module = model_states.get("module") or {}
    for scale in [k for k in module if k.endswith(".weight_scale")]:  # int8 base weights (parallel/int8.py), as saved
        weights[scale] = module[scale]
        weights[scale[: -len("_scale")]] = module[scale[: -len("_scale")]]
    return weights, {"state": state}
