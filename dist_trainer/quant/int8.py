"""int8 weights with group-wise absmax scales: quantise, dequantise, and the linear product on them (pure torch).

A weight W (out x in) is cut into groups of ``g`` consecutive input columns per output row; each group keeps
one fp32 scale s = absmax / 127 and its values as q = round(W / s) in [-127, 127] (symmetric absmax
quantisation, the round-to-nearest baseline of LLM.int8 and QLoRA's block-wise constants; Dettmers et al. 2022,
arXiv 2208.07339, section 3.1, and 2023, arXiv 2305.14314). Everything is per group, so quantising any block of
whole groups (a TP shard, a streamed slice) gives the same q and s as quantising the full matrix and slicing it.
``g`` = in is per-channel (one scale per output row): what ``export --quantize int8`` writes.

The product ``int8_linear`` never builds the whole dequantised matrix: forward and backward dequantise a block
of output rows at a time (``CHUNK_VALUES``) and keep only the int8 codes and the scales for backward, never the
input (the weight is frozen: no weight gradient reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

QMAX = 127  # symmetric: -127..127 (the code -128 is never produced)
CHUNK_VALUES = 1 << 24  # dequantised values alive at once in int8_linear (64 MiB in fp32)


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W (out, in) -> (q int8 (out, in), scale fp32 (out, in // group)): q = round(W / s), s = group absmax / 127."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"quantize: {cols} input columns are not a multiple of the group size {group}")
    blocks = w.detach().float().reshape(rows, cols // group, group)
    scale = blocks.abs().amax(dim=-1) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: codes 0, scale 0
    q = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(rows, cols), scale


def expand_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """``scale`` broadcast to a weight of ``shape``: one per group of the last dim, or broadcastable as it is (a
    per-channel scale stored (out, 1), or (1, out) beside a transposed weight)."""
    if scale.shape[-1] in (1, shape[-1]):
        return scale
    return scale.repeat_interleave(shape[-1] // scale.shape[-1], dim=-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * s in ``dtype`` (the product in fp32, then cast)."""
    return (q.float() * expand_scale(scale.float(), q.shape)).to(dtype)


def _row_blocks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_VALUES // max(cols, 1))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


class _Int8Linear(torch.autograd.Function):
    """y = x W^T with W = dequantize(q, s), a block of rows at a time; backward gives x's gradient only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, scale)  # the int8 buffers themselves (no copy); never x
        ctx.x_dtype = x.dtype
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        blocks = _row_blocks(*q.shape)
        outs = [F.linear(x.to(dtype), dequantize(q[a:b], scale[a:b], dtype)) for a, b in blocks]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        q, scale = ctx.saved_tensors
        grad_x = None
        for a, b in _row_blocks(*q.shape):
            part = grad[..., a:b].matmul(dequantize(q[a:b], scale[a:b], grad.dtype))
            grad_x = part if grad_x is None else grad_x.add_(part)
        assert grad_x is not None
        return grad_x.to(ctx.x_dtype), None, None


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize(q, scale), bias)`` without the whole dequantised weight, forward or backward."""
    y = _Int8Linear.apply(x, q, scale)
    return y if bias is None else y + bias.to(y.dtype)


def dequantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every ``<m>.weight`` that has a ``<m>.weight_scale`` beside it dequantised to fp32 and the
    scales dropped: an int8-base checkpoint (or an int8 export) read as plain weights."""
    out = {k: v for k, v in state.items() if not k.endswith(".weight_scale")}
    for key, scale in state.items():
        if key.endswith(".weight_scale"):
            weight = key[: -len("_scale")]
            out[weight] = dequantize(state[weight], scale)
    return out


def read_dequantized(read: Callable[[str, int | None, int, int | None], torch.Tensor],
                     shape: Callable[[str], tuple[int, ...]], name: str, dim: int | None, start: int,
                     stop: int | None) -> torch.Tensor:
    """Elements [start, stop) along ``dim`` of the int8 tensor ``name`` in fp32, read through ``read(tensor, dim,
    start, stop)`` beside its ``<name>_scale`` (per row, per column of a transposed Hugging Face tensor, or per
    group of columns): a cut along a dim the scale follows element for element (or is 1 along) reads only its
    codes; a cut across scale groups (a row-parallel shard of a grouped weight) dequantises the tensor first, one
    tensor at a time."""
    scale = f"{name}_scale"
    if dim is None:
        return dequantize(read(name, None, 0, None), read(scale, None, 0, None))
    stop = shape(name)[dim] if stop is None else stop
    along = shape(scale)[dim]
    if along == shape(name)[dim]:
        return dequantize(read(name, dim, start, stop), read(scale, dim, start, stop))
    if along == 1:
        return dequantize(read(name, dim, start, stop), read(scale, None, 0, None))
    w = dequantize(read(name, None, 0, None), read(scale, None, 0, None))
    return w.narrow(dim, start, stop - start).contiguous()


def quantize_per_channel(w: torch.Tensor, channel_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8 with one scale per output channel (``export --quantize int8``): channels along
    ``channel_dim`` (0 for our (out, in) weights, 1 for a transposed (in, out) Hugging Face Conv1D); the scale keeps
    the weight's rank, 1 along the other dim, so it broadcasts."""
    if channel_dim == 1:
        q, s = quantize_per_channel(w.t(), 0)
        return q.t().contiguous(), s.t().contiguous()
    return quantize(w, w.shape[1])
