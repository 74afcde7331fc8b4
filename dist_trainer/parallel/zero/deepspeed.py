"""Mechanisms the ZeRO regimes need from DeepSpeed: a quiet start, the model-parallel unit, TP and pipeline
parameters tagged for ZeRO, a partitioned init.

``quiet_deepspeed`` keeps DeepSpeed on the existing gloo/NCCL group without JIT-building its shared-memory
op; ``DeepSpeedMpu`` is DeepSpeed's model-parallel-unit protocol over our ``ParallelState`` (tp x pp model
parallelism, as Megatron-DeepSpeed hands it over); ``prepare_for_deepspeed`` gives TP-split, partial-gradient
and tied-copy parameters what ZeRO's gradient norm and reductions read; ``init_partitioned`` replays the seed's
weights into a model built under ``deepspeed.zero.Init``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from dist_trainer.model import Transformer
from dist_trainer.model_blocks import init_weights_, set_attrs
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.grad import sum_partial_grads_in_backward


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
    """DeepSpeed's model-parallel-unit protocol (Megatron's ``mpu``) over our ParallelState.

    - data parallel: the ranks holding the same parameters (``state.replicas``: the replica axes flattened, dp
      alone when the others have one rank). ZeRO partitions over them, and only over them (ZeRO-3's partitions
      of a TP shard never cross TP ranks).
    - model parallel: every rank with the same replica index (the tp x pp block of the mesh). ZeRO sums the squared
      gradient norm over dp and then over this group (deepspeed/runtime/zero/stage_1_and_2.py:2693-2695,
      stage3.py:2472), so every stage and every TP shard counts. Its rank, ``pp_rank * tp_size + tp_rank``, is
      the ``mp_rank_XX`` of DeepSpeed's checkpoint file names: one per (tp, pp) coordinate.
    - tensor model parallel: our tp axis. ZeRO-1/2 count a parameter that is not ``tensor_model_parallel`` only
      where this rank is 0 (stage_1_and_2.py:316 via deepspeed/utils/bwc.py, :2682), so a TP-replicated parameter
      counts once. ZeRO-3 reads ``get_model_parallel_rank`` for the same test (stage3.py:376): equal to the tp rank
      at pp_size 1, the only layout where ZeRO-3 runs with TP (layout_rules.check_composition).

    No ``initialize_sequence_parallel`` attribute: with one, DeepSpeed ignores the model-parallel group
    (stage_1_and_2.py:309, stage3.py:371). ParallelState creates no group for a one-rank axis, but DeepSpeed
    reduces over whatever group the mpu returns (None would mean the whole world), so a one-rank axis is a group
    of this rank alone. Construction is collective (``dist.new_group``): every rank, once, in the same order.
    """

    def __init__(self, state: ParallelState) -> None:
        self.state = state
        self.mp_size = state.tp_size * state.pp_size
        self._alone: dist.ProcessGroup | None = None
        if 1 in (state.replicas.size, state.tp_size, self.mp_size):
            for r in range(state.world_size):
                group = dist.new_group([r])
                if r == state.rank:
                    self._alone = group
        self._mp_group: dist.ProcessGroup | None = state.tp.group if state.pp_size == 1 else None
        if state.pp_size > 1:  # one tp x pp block per replica index, pp-major as get_model_parallel_rank
            for ranks in state.mesh.lines("pp", "tp"):
                group = dist.new_group(list(ranks))
                if state.rank in ranks:
                    self._mp_group = group

    def _or_alone(self, group: dist.ProcessGroup | None, size: int, axis: str) -> dist.ProcessGroup:
        group = group if size > 1 else self._alone
        assert group is not None, f"no process group for the {axis} axis"
        return group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._or_alone(self.state.replicas.group, self.state.replicas.size, "replicas")

    def get_data_parallel_rank(self) -> int:
        return self.state.replicas.rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.replicas.size

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._or_alone(self._mp_group, self.mp_size, "tp x pp")

    def get_model_parallel_rank(self) -> int:
        return self.state.pp_rank * self.state.tp_size + self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.mp_size

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self._or_alone(self.state.tp.group, self.state.tp_size, "tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.state.tp_size


def prepare_for_deepspeed(model: nn.Module, state: ParallelState) -> None:
    """Tag this rank's (TP-sharded, pipeline-split) parameters the way DeepSpeed's ZeRO reads them, in place.

    Call after ``apply_tensor_parallel`` and ``build_schedule`` (both replace or tag Parameters), before
    ``deepspeed.initialize``.

    - Megatron's attributes on every TP-split parameter: ``tensor_model_parallel`` is what
      ``is_model_parallel_parameter`` reads (deepspeed/runtime/utils.py:134) when ZeRO's gradient norm counts a
      shard on every TP rank and a replicated parameter on tp rank 0 only; ``partition_dim``/``partition_stride``
      are read only by DeepSpeed's universal checkpoints (checkpoint/universal_checkpoint.py:153), set for parity.
    - The partial gradients of ``tp_reduce_grad`` parameters (sequence-parallel norms, row-parallel biases,
      replicated GQA k/v) are summed over TP inside backward (``tp.grad.sum_partial_grads_in_backward``):
      ZeRO-2/3 take ``.grad`` in their own hooks, before any step after backward could sum it.
    - The last pipeline stage's copy of a tied embedding (``pp_shared_copy``) gets ``ds_pipe_replicated``
      (deepspeed/runtime/constants.py:408): ZeRO's norm skips it (stage_1_and_2.py:2680), so the embedding counts
      once, and the clip coefficient still scales it, so both copies take the same step.
    """
    for p in {id(p): p for p in model.parameters()}.values():
        dim = getattr(p, "tp_split_dim", None)
        if dim is not None:
            set_attrs(p, tensor_model_parallel=True, partition_dim=dim, partition_stride=1)
        if getattr(p, "pp_shared_copy", False):
            set_attrs(p, ds_pipe_replicated=True)
    sum_partial_grads_in_backward(model, state)


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
