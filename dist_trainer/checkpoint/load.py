"""Fill a rank's model with the slices it owns of a ``WeightSource``, one tensor at a time.

Called after the regime has cut the model (TP shards, a pipeline rank's stages, its experts, ZeRO-3 partitions):
each parameter reads exactly its own part of the source, so no rank ever holds more of the source than it owns
plus one tensor. A TP shard is rows (or columns) [r c, (r + 1) c) of the full tensor zero-padded to a multiple of
tp (``parallel/tp/layers.shard_of``); a ZeRO-3 partition is elements [r n, (r + 1) n) of the flattened tensor
(DeepSpeed's ``ds_tensor``), read as the rows that cover them. Adapters keep their own draw.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from dist_trainer.checkpoint.checkpoint_source import read_tp_shard
from dist_trainer.checkpoint.source import WeightSource
from dist_trainer.model_lora import is_adapter
from dist_trainer.parallel.int8 import Int8Weight, int8_layers
from dist_trainer.parallel.tp.reshard import ShardSpec


def _full_shape(p: nn.Parameter, tp_size: int) -> tuple[int, ...]:
    """The unsplit shape of a (TP-sharded or ZeRO-3-partitioned) parameter."""
    if hasattr(p, "ds_shape"):
        return tuple(p.ds_shape)
    shape = list(p.shape)
    dim = getattr(p, "tp_split_dim", None)
    if dim is not None:
        shape[dim] = int(p.tp_full_size)  # type: ignore[attr-defined]
    return tuple(shape)


def _int8_full_shape(module: Int8Weight) -> tuple[int, ...]:
    shape = list(module.weight.shape)
    dim, full = module.weight_split
    if dim is not None:
        shape[dim] = int(full)  # type: ignore[arg-type]
    return tuple(shape)


def check_fits(source: WeightSource, named: Iterable[tuple[str, nn.Parameter]], tp_size: int,
               what: str = "train.init_from", int8: Iterable[tuple[str, Int8Weight]] = ()) -> None:
    """ValueError naming the parameters (and int8 weights) the source lacks or holds in another shape (before
    anything is copied)."""
    own = {n: _full_shape(p, tp_size) for n, p in named if not is_adapter(n)}
    own.update({f"{n}.weight": _int8_full_shape(m) for n, m in int8})
    have = source.names()
    missing = sorted(set(own) - have)
    wrong = [(n, source.shape(n), own[n]) for n in sorted(set(own) & have) if tuple(source.shape(n)) != own[n]]
    if missing or wrong:
        raise ValueError(f"{what}={source.where}: its weights do not fit this model: missing {missing[:5]}, other "
                         f"shapes (source, model) {wrong[:5]}")


def _tp_slice(source: WeightSource, name: str, p: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    dim = getattr(p, "tp_split_dim", None)
    spec = ShardSpec(dim, None if dim is None else int(p.tp_full_size))  # type: ignore[attr-defined]
    return read_tp_shard(lambda d, a, b: source.read(name, d, a, b), spec, tp_rank, tp_size, tuple(p.shape))


def _zero3_partition(source: WeightSource, name: str, p: torch.Tensor) -> torch.Tensor:
    """This rank's flat ZeRO-3 partition of ``name``: the rows that cover it, flattened and cut."""
    import torch.distributed as dist

    part = p.ds_tensor  # type: ignore[attr-defined]
    rank = dist.get_rank(group=p.ds_process_group)  # type: ignore[attr-defined]
    shape = tuple(p.ds_shape)  # type: ignore[attr-defined]
    numel, n = math.prod(shape), part.numel()
    start, stop = rank * n, min((rank + 1) * n, numel)
    out = torch.zeros(n, dtype=part.dtype)
    if stop > start:
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        first, last = start // row, -(-stop // row)
        rows = source.read(name, 0, first, last).reshape(-1)
        out[: stop - start] = rows[start - first * row: stop - first * row]
    return out


@torch.no_grad()
def load_owned_(model: nn.Module, source: WeightSource, tp_rank: int = 0, tp_size: int = 1,
                what: str = "train.init_from") -> None:
    """Every base parameter of ``model`` (a rank's cut of the plain model, under its names) from ``source``; an int8
    linear's weight (``parallel/int8.py``) quantised from its slice as that one tensor streams in; a saved buffer
    the source holds (a MoE layer's ``expert_bias``, whole on every rank) copied as it is."""
    named = [(n, p) for n, p in model.named_parameters() if not is_adapter(n)]
    int8 = list(int8_layers(model))
    check_fits(source, named, tp_size, what, int8)
    for name, p in named:
        if hasattr(p, "ds_tensor"):
            p.ds_tensor.copy_(_zero3_partition(source, name, p).to(p.ds_tensor.dtype))
        else:
            p.copy_(_tp_slice(source, name, p, tp_rank, tp_size).to(p.dtype))
    saved = set(model.state_dict(keep_vars=True)) & source.names()
    for name, buf in model.named_buffers():
        if name in saved and not any(name.startswith(f"{m}.") for m, _ in int8):
            buf.copy_(source.read(name).to(buf.dtype))
    for name, module in int8:
        dim, full = module.weight_split
        read = lambda d, a, b, n=f"{name}.weight": source.read(n, d, a, b)  # noqa: E731
        module.load_weight_(read_tp_shard(read, ShardSpec(dim, full), tp_rank, tp_size, tuple(module.weight.shape)))


