"""Frozen linears with int8 weights: one module class per linear kind, swapped in by name (``model.base_weight_dtype``).

``apply_int8`` replaces each frozen layer linear that ``facts/quant_sizes.int8_modules`` names (LoRA's base,
or what ``train.freeze`` covers) by its int8 class: the plain ``nn.Linear`` / ``LoRALinear``, or the TP layer that
already cut this rank's shard (column-, row-parallel, replicated k/v). The new module keeps everything of the old
one (its TP group and flags, its bias, its adapter and their names) but the weight, which becomes two buffers:

    <module>.weight         int8 (out, in) on this rank      (the same name: checkpoints read it by name)
    <module>.weight_scale   fp32 (out, in // g)              (g = model.base_weight_group)

and its product, ``base_linear``, is ``quant/int8.int8_linear`` (dequantised a block of rows at a time). A TP
rank quantises its own shard: groups never cross a shard's edge (``quant_sizes.check_int8_layout``), so the codes and
scales equal the full matrix's, sliced (tests/test_low_bit.py). Buffers, not parameters: no optimizer, DDP bucket
or ZeRO partition sees them (DDP is told not to broadcast them: ``int8_buffer_names``), the owned-bytes count adds
them (``int8_buffers``), and ``buffer_specs`` tells the checkpoint code how TP splits them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from dist_trainer.facts.quant_sizes import int8_modules
from dist_trainer.model_lora import LoRALinear
from dist_trainer.parallel.tp.layers import ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear
from dist_trainer.quant.int8 import int8_linear, quantize


class Int8Weight:
    """The int8 storage and product of a frozen linear (mixed into each linear kind below)."""

    weight: torch.Tensor  # int8 buffer (out, in) on this rank
    weight_scale: torch.Tensor  # fp32 buffer (out, in // weight_group)
    weight_group: int
    weight_split: tuple[int | None, int | None]  # TP split of the weight: (dim, full size along it) or (None, None)

    def base_linear(self, x: torch.Tensor, bias: torch.Tensor | None, rows: slice | None = None) -> torch.Tensor:
        q, scale = (self.weight, self.weight_scale) if rows is None else (self.weight[rows], self.weight_scale[rows])
        return int8_linear(x, q, scale, bias)

    def buffer_specs(self) -> dict[str, tuple[int | None, int | None]]:
        """How TP splits the two buffers (read by ``parallel/tp/reshard.tp_shard_specs``): the codes as the weight
        was, the scales along the same dim (whole groups: full size in // g when the input columns are split)."""
        dim, full = self.weight_split
        scale_full = None if dim is None else (full if dim == 0 else full // self.weight_group)  # type: ignore[operator]
        return {"weight": (dim, full), "weight_scale": (dim, scale_full)}

    def load_weight_(self, full_slice: torch.Tensor) -> None:
        """Quantise this rank's slice of the full-precision weight (one streamed tensor) into the buffers."""
        q, scale = quantize(full_slice, self.weight_group)
        self.weight.copy_(q)
        self.weight_scale.copy_(scale.to(self.weight_scale.dtype))

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]  # the linear kind's own description
        int8 = f"int8 weight {tuple(self.weight.shape)}, one scale per {self.weight_group} input columns"
        return f"{base}, {int8}" if base else int8


class Int8Linear(Int8Weight, nn.Module):
    """A frozen ``nn.Linear`` (no adapter) with int8 weights."""

    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_linear(x, self.bias)


class Int8LoRALinear(Int8Weight, LoRALinear):
    """LoRA's frozen base W0 in int8; the adapter as in ``LoRALinear``."""


class Int8ColumnParallelLinear(Int8Weight, ColumnParallelLinear):
    """This rank's output rows of a column-parallel linear, in int8."""


class Int8RowParallelLinear(Int8Weight, RowParallelLinear):
    """This rank's input columns of a row-parallel linear, in int8 (whole scale groups)."""


class Int8ReplicatedKVLinear(Int8Weight, ReplicatedKVLinear):
    """A k/v projection every TP rank keeps whole, in int8."""


INT8_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: Int8Linear, LoRALinear: Int8LoRALinear, ColumnParallelLinear: Int8ColumnParallelLinear,
    RowParallelLinear: Int8RowParallelLinear, ReplicatedKVLinear: Int8ReplicatedKVLinear,
}


def to_int8(module: nn.Module, group: int) -> nn.Module:
    """A new module of ``module``'s int8 class holding what ``module`` holds, its weight quantised (on the meta
    device: empty buffers, filled when the weights stream in: ``load_weight_``)."""
    cls = INT8_CLASSES.get(type(module))
    if cls is None:
        raise TypeError(f"no int8 class for {type(module).__name__}")
    weight = module.weight
    assert isinstance(weight, nn.Parameter) and not weight.requires_grad, "only frozen weights are stored in int8"
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)  # the module's attributes (TP group, flags, adapter scaling, lora_key)
    new._parameters = {k: v for k, v in module._parameters.items() if k != "weight"}
    new._buffers = dict(module._buffers)
    new._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    new._modules = dict(module._modules)
    rows, cols = weight.shape
    if weight.is_meta:
        q = torch.empty(rows, cols, dtype=torch.int8, device="meta")
        scale = torch.empty(rows, cols // group, device="meta")
    else:
        q, scale = quantize(weight, group)
    new.register_buffer("weight", q)
    new.register_buffer("weight_scale", scale)
    dim = getattr(weight, "tp_split_dim", None)
    full = None if dim is None else int(weight.tp_full_size)  # type: ignore[attr-defined]
    vars(new).update(weight_group=group, weight_split=(dim, full))
    return new


def apply_int8(model: nn.Module, model_cfg: object, freeze: Sequence[str],
                           first_layer: int = 0) -> list[str]:
    """Swap every frozen layer linear of ``model`` (a rank's cut of the plain model, under the plain names; a pipeline
    stage's ``layers.i`` being global layer ``first_layer + i``) for its int8 class; the names swapped (none unless
    ``model.base_weight_dtype`` is int8)."""
    wanted = set(int8_modules(model_cfg, freeze))  # type: ignore[arg-type]
    done = []
    for name, module in list(model.named_modules()):
        parts = name.split(".")
        if first_layer and len(parts) > 1 and parts[0] == "layers":
            parts[1] = str(int(parts[1]) + first_layer)
        if ".".join(parts) in wanted and not isinstance(module, Int8Weight):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, to_int8(module, model_cfg.base_weight_group))  # type: ignore[attr-defined]
            done.append(name)
    return done


def int8_layers(model: nn.Module) -> Iterator[tuple[str, Int8Weight]]:
    """(name, module) of every int8 linear of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, Int8Weight):
            yield name, module


def int8_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The int8 codes and scales ``model`` holds (model state beside its parameters)."""
    return [t for _, m in int8_layers(model) for t in (m.weight, m.weight_scale)]


def int8_buffer_names(model: nn.Module) -> list[str]:
    """Their full names, as ``model.state_dict()`` keys them."""
    return [f"{name}.{b}" for name, _ in int8_layers(model) for b in ("weight", "weight_scale")]


def materialize_int8_(model: nn.Module, device: str | torch.device = "cpu") -> None:
    """Give meta int8 buffers empty storage (a model built on the meta device, whose weights stream in next)."""
    for _, module in int8_layers(model):
        assert isinstance(module, nn.Module)
        for name in ("weight", "weight_scale"):
            buf = getattr(module, name)
            if buf.is_meta:
                module.register_buffer(name, torch.empty(buf.shape, dtype=buf.dtype, device=device))
