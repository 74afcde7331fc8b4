"""Mechanisms the ZeRO engine needs from DeepSpeed: a quiet start, the model-parallel unit, a partitioned init.

``quiet_deepspeed`` keeps DeepSpeed on the existing gloo/NCCL group without JIT-building its shared-memory
op; ``DeepSpeedMpu`` is DeepSpeed's model-parallel-unit protocol over our ``ParallelState``;
``init_partitioned`` replays the seed's weights into a model built under ``deepspeed.zero.Init``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dist_trainer.model import Transformer, init_weights_
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.state import ParallelState


def quiet_deepspeed() -> None:
    """Use the existing torch.distributed (gloo) group without DeepSpeed's shared-memory all-reduce op.

    deepspeed.comm.TorchBackend JIT-compiles ``deepspeed_shm_comm`` on CPU whenever
    ``deepspeed.ops.__compatible_ops__`` marks it compatible (deepspeed/comm/torch.py, build_shm_op), ~25 s per
    fresh process; the dict is cached in the module (``deepspeed/ops/__init__.py``), so marking the op unavailable
    makes DeepSpeed fall back to torch.distributed's gloo collectives, which is what we run anyway.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed.ops

    # Setting the dict before its first access also skips DeepSpeed's probe of every op (compiler subprocesses);
    # comm/torch.py is its only reader in 0.19.8, and a missing entry reads as "not compatible".
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


class DeepSpeedMpu:
    """DeepSpeed's model-parallel-unit protocol over our ParallelState (tp and pp are 1: see
    layout_rules.check_composition)."""

    def __init__(self, state: ParallelState) -> None:
        self.state = state
        # ParallelState creates no group for a one-rank axis, but DeepSpeed reduces over whatever group the mpu
        # returns: a one-rank axis must be a group of this rank alone (None would mean the whole world).
        # new_group is collective, so every rank creates every singleton, in rank order.
        self._alone: dist.ProcessGroup | None = None
        if any(a.size == 1 for a in (state.dp, state.tp)):
            for r in range(state.world_size):
                group = dist.new_group([r])
                if r == state.rank:
                    self._alone = group

    def _group(self, axis: AxisGroup) -> dist.ProcessGroup:
        group = axis.group if axis.size > 1 else self._alone
        assert group is not None, f"no process group for the {axis.axis} axis"
        return group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._group(self.state.dp)

    def get_data_parallel_rank(self) -> int:
        return self.state.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._group(self.state.tp)

    def get_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size


@torch.no_grad()
def init_partitioned(model: Transformer) -> None:
    """Replay ``Transformer.reset_parameters`` on a ZeRO-3 model, gathering one module's params at a time.

    Same modules, same order, same draws from the global RNG (seeded identically on every rank), so the
    partitions are the slices of the single-process draw; ``tests/test_zero_parity.py`` checks it bit for bit.
    Under ``zero.Init`` the constructor's own call found only empty partitions and drew nothing.
    """
    import deepspeed

    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        with deepspeed.zero.GatheredParameters(own, modifier_rank=0):
            init_weights_(module, model.cfg)
