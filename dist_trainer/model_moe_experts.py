"""The routed experts on rows sorted by expert (dropless routing): one grouped matmul per projection, or a loop.

``run_experts_sorted(experts, rows, counts)``: ``rows`` (N, d) hold expert 0's rows, then expert 1's, ... (``counts``
of each); the result is each row through its expert's MLP, in the same order.

- grouped: the experts' weights stacked to (E, out, in) per projection and ``torch._grouped_mm`` over the segments
  (``offs`` their cumulative ends): three launches for every expert of the layer, the computation Megatron-core's
  GroupedMLP, torchtitan's and MaxText's MoE run. Taken where ``torch._grouped_mm`` runs the dtype (CPU; CUDA from
  compute capability 9.0 in bf16) and the experts are plain linears (no bias, LoRA adapter or int8 base). The
  stacked weights are a transient copy in forward and again in backward, never saved (the parameters stay one
  module per expert, under the names checkpoints, optimizer states and expert parallelism use).
- loop: each expert's module on its segment (every other case; an empty segment still runs, so every expert's
  parameters get a gradient in every layout).

``benchmarks/moe_grouped.py`` measures the two side by side.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn


class _GroupedLinear(torch.autograd.Function):
    """Rows in segments (ending at ``offs``) times their expert's weight, transposed: one ``torch._grouped_mm``.

    The stacked (E, in, out) weights are a transient copy, rebuilt in backward rather than saved: what stays for
    backward is the rows and the parameters themselves, as with one linear per expert. Backward is
    ``torch._grouped_mm``'s own rule: d rows = grad x W_e per segment, dW_e = (rows_e^T grad_e)^T."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, _stacked(weights, x.dtype), offs=offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous().to(x.dtype)
        dx = torch._grouped_mm(grad, _stacked(weights, x.dtype).transpose(-2, -1), offs=offs)
        dw = torch._grouped_mm(x.t(), grad, offs=offs)  # (E, in, out)
        return (dx, None, *(d.t().to(w.dtype) for d, w in zip(dw.unbind(0), weights, strict=True)))


def _stacked(weights: tuple[torch.Tensor, ...] | list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """(E, in, out): each (out, in) weight transposed, in ``dtype``."""
    return torch.stack([w.to(dtype) for w in weights]).transpose(-2, -1)


def _plain(linear: nn.Module | None) -> bool:
    return linear is None or (type(linear) is nn.Linear and linear.bias is None)


def grouped_supported(experts: list[nn.Module], rows: torch.Tensor) -> bool:
    """Whether the grouped path computes these experts on ``rows`` (module docstring)."""
    if not hasattr(torch, "_grouped_mm") or not experts:
        return False
    if not all(_plain(getattr(e, n, None)) for e in experts for n in ("up_proj", "gate_proj", "down_proj")):
        return False
    dtype = torch.get_autocast_dtype(rows.device.type) if torch.is_autocast_enabled(rows.device.type) else rows.dtype
    if rows.device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    return rows.is_cuda and dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device) >= (9, 0)


def _grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], offs: torch.Tensor) -> torch.Tensor:
    """(N, in) rows in segments ending at ``offs`` -> (N, out): segment e times weights[e].T."""
    return _GroupedLinear.apply(x, offs, *weights)


def _weights(experts: list[nn.Module], name: str) -> list[torch.Tensor]:
    return [cast(nn.Linear, e.get_submodule(name)).weight for e in experts]


def run_grouped(experts: list[nn.Module], rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The experts' MLPs on their segments of ``rows`` as three grouped matmuls (module docstring)."""
    dtype = torch.get_autocast_dtype(rows.device.type) if torch.is_autocast_enabled(rows.device.type) else rows.dtype
    offs = counts.cumsum(0).to(torch.int32)
    with torch.autocast(rows.device.type, enabled=False):
        x = rows.to(dtype)
        up = _grouped_linear(x, _weights(experts, "up_proj"), offs)
        gated = getattr(experts[0], "gate_proj", None) is not None
        gate = _grouped_linear(x, _weights(experts, "gate_proj"), offs) if gated else None
        hidden = experts[0].hidden(up, gate)  # type: ignore[operator]  # model_blocks.MLP.hidden
        return _grouped_linear(hidden, _weights(experts, "down_proj"), offs)


def run_loop(experts: list[nn.Module], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's module on its segment of ``rows``, concatenated (the segment loop)."""
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, rows.split(counts), strict=True)])


def run_experts_sorted(experts: list[nn.Module], rows: torch.Tensor, counts: torch.Tensor, *,
                       grouped: bool = True) -> torch.Tensor:
    """(N, d) rows sorted by expert, ``counts`` (E,) rows per expert -> (N, d) outputs (grouped where supported)."""
    if grouped and grouped_supported(experts, rows):
        return run_grouped(experts, rows, counts)
    return run_loop(experts, rows, counts.tolist())
