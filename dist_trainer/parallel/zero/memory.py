"""The bytes of model states a rank really owns: parameters, gradients, optimizer states.

On CPU, ZeRO-3 does not lower RSS (freed partitions stay in the allocator), so partitioning is checked on
the tensors themselves: every tensor the rank's engine holds in each category, counted once per storage
(DeepSpeed's per-parameter views share its flat buffers). The ZeRO paper's accounting (Rajbhandari et al.
2019, section 3.1: 2 Psi + 2 Psi + K Psi, K sharded by stage 1, grads by 2, params by 3) is what it verifies.

DeepSpeed's ZeRO optimizers keep an fp32 master partition even when the model itself is fp32
(``single_partition_of_fp32_groups`` in stage_1_and_2.py, ``fp32_partitioned_groups_flat`` in stage3.py), so
an fp32 AdamW ZeRO rank holds (4 master + 8 moments) Psi / N optimizer bytes, not 8 Psi / N.

With TP and pipeline stages Psi is the rank's own shard and N its dp replicas (DeepSpeed partitions over the dp
group only). With the optimizer offloaded, the fp32 gradient partition (and, across micro-batches, the
accumulated gradients) sit in host memory beside the master and are counted as gradients here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes covered by the tensors, each byte once: DeepSpeed's per-parameter grads and params are views
    of flat partition buffers that are reached again through the buffer itself (union of byte ranges)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in tensors if isinstance(t, torch.Tensor) and t.numel() > 0)
    total, end = 0, -1
    for lo, hi in spans:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def optimizer_moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer state tensors that scale with the parameters (Adam's "step" is a scalar per group)."""
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]


def zero_owned_bytes(ds_optimizer: Any, params: list[torch.Tensor], stage: int) -> dict[str, int]:
    """{"params", "grads", "optimizer"} bytes a DeepSpeed ZeRO rank holds: its parameter partitions (stage 3) or
    parameters, the gradients alive now (module grads and DeepSpeed's partitions; call it between backward and
    the optimizer step), its fp32 master partition and the moments of the wrapped optimizer."""
    module_grads = [p.grad for p in params]
    if stage == 3:
        param_tensors = [p.ds_tensor for p in params]  # type: ignore[attr-defined]
        partition_grads = list(getattr(ds_optimizer, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
                                       {}).values())
        master = list(ds_optimizer.fp32_partitioned_groups_flat)
    else:
        param_tensors = params
        partition_grads = [g for group in ds_optimizer.averaged_gradients.values() for g in group or []] \
            if isinstance(ds_optimizer.averaged_gradients, dict) else []
        master = list(ds_optimizer.single_partition_of_fp32_groups)
        if getattr(ds_optimizer, "grads_in_partition", None) is not None:  # stage 2's contiguous partition buffer
            partition_grads.append(ds_optimizer.grads_in_partition)
        if getattr(ds_optimizer, "cpu_offload", False):
            # offloaded: the fp32 gradient partition beside the master in host memory (offload_gradient_dict views
            # it), and across micro-batches each partition parameter's accumulated gradient (stage_1_and_2.py:1853)
            partition_grads += [m.grad for m in master]
            partition_grads += list(getattr(ds_optimizer, "accumulated_grads_in_cpu", {}).values())
    return {"params": unique_bytes(param_tensors),
            "grads": unique_bytes(module_grads + partition_grads),
            "optimizer": unique_bytes(master + optimizer_moments(ds_optimizer.optimizer))}
