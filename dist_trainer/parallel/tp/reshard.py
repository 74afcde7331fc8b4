"""Checkpoint resharding across tensor-parallel sizes.

A TP model keeps the plain model's parameter names; each parameter is either replicated
or cut into tp contiguous slices along one dim (``tp_split_dim``), after zero-padding
that dim to a multiple of tp (vocabulary rows only: the other split dims are validated
to be divisible). Contiguous slices are all the layouts need:

- q/k/v are column blocks of whole heads (head h = rows [h*D, (h+1)*D)), so a
  contiguous cut of the output rows is a cut between heads, for GQA k/v too;
- o_proj is cut by input columns in the same head order (q_dim = n_heads * head_dim wide, whatever d_model is);
- a QK-norm over the full width (model.qk_norm=full) is cut with its projection's rows (whole heads); one per
  head is replicated;
- SwiGLU keeps up and gate as separate projections, so each splits on its own
  (a fused [up; gate] weight would need an interleaved split);
- padded vocabulary rows are zeros on load and stripped on merge.

``slice_for_tp`` / ``merge_tp_shards`` work on any dict of tensors keyed by parameter
name, so AdamW's exp_avg / exp_avg_sq reshard with the same code as the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dist_trainer.parallel.tp.layers import shard_of


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out over TP ranks."""

    dim: int | None  # split dim; None = replicated on every TP rank
    full_size: int | None  # unpadded full length along ``dim`` (None when replicated)


def tp_shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """{parameter name: ShardSpec} for a model (TP or plain: a plain one is all replicated), and the buffers that are
    model state (int8 base weights and their scales, ``parallel/int8.py``), which their module declares in
    ``buffer_specs``."""
    specs = {}
    for name, p in model.named_parameters():
        dim = getattr(p, "tp_split_dim", None)
        specs[name] = ShardSpec(dim, None if dim is None else getattr(p, "tp_full_size", None))
    for prefix, module in model.named_modules():
        declared = getattr(module, "buffer_specs", None)
        if declared is not None:
            specs.update({f"{prefix}.{b}": ShardSpec(*spec) for b, spec in declared().items()})
    return specs


def _check_keys(keys: set[str], specs: dict[str, ShardSpec], what: str) -> None:
    if keys != set(specs):
        raise ValueError(f"{what}: tensor names do not match the model's parameters; missing "
                         f"{sorted(set(specs) - keys)}, unexpected {sorted(keys - set(specs))}")


def merge_tp_shards(shards: list[dict[str, torch.Tensor]], specs: dict[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """TP rank-ordered shard dicts -> full, unpadded tensors keyed by parameter name."""
    if not shards:
        raise ValueError("merge_tp_shards: no shards given")
    for r, shard in enumerate(shards):
        _check_keys(set(shard), specs, f"merge_tp_shards (TP rank {r})")
    full = {}
    for name, spec in specs.items():
        if spec.dim is None:
            full[name] = shards[0][name].clone()
            continue
        cat = torch.cat([s[name] for s in shards], dim=spec.dim)
        assert spec.full_size is not None, f"{name}: a split parameter records its full size"
        if cat.shape[spec.dim] < spec.full_size:
            raise RuntimeError(f"merge_tp_shards: {name} gathers to {cat.shape[spec.dim]} along dim {spec.dim}, "
                               f"expected at least {spec.full_size}")
        full[name] = cat.narrow(spec.dim, 0, spec.full_size).clone()  # strip vocabulary padding
    return full


def slice_for_tp(full: dict[str, torch.Tensor], specs: dict[str, ShardSpec], tp_rank: int,
                 tp_size: int) -> dict[str, torch.Tensor]:
    """Full tensors -> this TP rank's shards (zero-padded where the layout pads)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"slice_for_tp: tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    _check_keys(set(full), specs, "slice_for_tp")
    out = {}
    for name, spec in specs.items():
        t = full[name]
        if spec.dim is None:
            out[name] = t.clone()
            continue
        if t.shape[spec.dim] != spec.full_size:
            raise RuntimeError(f"slice_for_tp: {name} has {t.shape[spec.dim]} along dim {spec.dim}, "
                               f"expected the full size {spec.full_size}")
        out[name] = shard_of(t, spec.dim, tp_rank, tp_size)
    return out
