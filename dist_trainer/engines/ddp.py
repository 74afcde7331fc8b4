"""The DDP regime: torch DDP over the dp axis, Megatron tensor parallelism (and SP) inside each replica.

With expert parallelism (parallel/ep/) DDP leaves the experts alone: their gradients are reduced over the
expert-data-parallel group before clipping."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_trainer.config import Config
from dist_trainer.engines.base import Engine, autocast_for, clip_norm, sharded_model
from dist_trainer.engines.update import DenseUpdate
from dist_trainer.model import seq2seq_inputs
from dist_trainer.model_moe import expert_bias_buffers
from dist_trainer.optim import build_optimizer
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.ep.grad import expert_param_names
from dist_trainer.parallel.int8 import int8_buffer_names
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.grad import clip_grad_norm_


def _counting_allreduce_hook(dp: AxisGroup, bucket):  # noqa: ANN001 - DDP rejects string annotations here
    """DDP's own all-reduce (mean over dp) of a dist.GradBucket, counted, numbered and timed by the dp axis."""
    buf = bucket.buffer()
    group = dp.group
    assert group is not None, "DDP runs only over a dp group of more than one rank"
    return dp.track_async("all_reduce", buf.numel() * buf.element_size(),
                          lambda: default_hooks.allreduce_hook(group, bucket))


class DataParallelEngine(Engine):
    """DDP over the dp axis; Megatron TP (and SP) inside each replica when tp_size > 1."""

    def __init__(self, cfg: Config, state: ParallelState, device: torch.device) -> None:
        self.cfg = cfg
        self.state = state
        self.device = device
        self.name = "tp+ddp" if state.tp_size > 1 else "ddp"
        self.model = sharded_model(cfg, state, device)
        self.wrapped = self._wrap(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optim, tp=state.tp)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None
        self.update = DenseUpdate(self.model, self.optimizer, state, scaler=self.scaler, max_norm=clip_norm(cfg),
                                  clip=lambda max_norm: clip_grad_norm_(self.model, max_norm, state))

    def _wrap(self, model: nn.Module) -> nn.Module:
        dp = self.state.replicas  # the ranks holding the same parameters (layout_rules.REPLICA_AXES)
        if dp.size == 1:
            return model
        # expert-parallel experts differ across dp ranks: reduced over their own group (reduce_expert_grads); int8
        # base weights are the same frozen codes on every rank, the expert bias moves alike on every rank
        # (train/moe_balance.py): not broadcast before each forward
        bias = list(expert_bias_buffers(model))
        DDP._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model) + int8_buffer_names(model)
                                                        + bias)
        ddp = DDP(model, process_group=dp.group,
                  device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  find_unused_parameters=model.pooler is not None)  # the pooler takes no part in the MLM loss
        ddp.register_comm_hook(dp, _counting_allreduce_hook)
        return ddp

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        n = len(batches)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            # DDP all-reduces gradients only on the last micro-batch of the step.
            wrapped = self.wrapped
            sync = i == n - 1 or not isinstance(wrapped, DDP)
            with wrapped.no_sync() if isinstance(wrapped, DDP) and not sync else contextlib.nullcontext():
                with autocast_for(self.cfg.train.precision, self.device):
                    loss = wrapped(batch["tokens"], batch["targets"], **seq2seq_inputs(batch))
                scaled = loss / n
                # DDP's bucket all-reduces run under this backward, waited for at its end: the trace's dp (or
                # replicas) time (train/profile_split.py)
                with self.state.replicas.profiled("ddp gradient buckets") if sync else contextlib.nullcontext():
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach().float()
        return loss_sum

    def optimizer_step(self, lr: float) -> torch.Tensor:
        # TP partial sums, experts over edp, the hooks, the global norm over every rank's shards (TP-replicated
        # parameters once), clipped if asked, and the step
        return self.update.step(lr, self.step_hooks)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with autocast_for(self.cfg.train.precision, self.device):
            for batch in batches:
                total += self.model(batch["tokens"], batch["targets"], **seq2seq_inputs(batch)).float()
        self.model.train()
        return total
