"""Engines: what a regime does inside the one training loop.

The Trainer owns data, the schedule of steps, metrics and checkpoint publication; an
engine owns the model, the optimizer and how one step's micro-batches become an update.
Every regime implements the same five calls, so the loop never branches on the regime:

    forward_backward(batches) -> summed loss        the step's micro-batches on this rank
    optimizer_step(lr) -> grad norm                 finalize grads, clip, step, zero grads
    eval_loss(batches) -> summed loss               no-grad forward
    save_shards(folder)                             this rank's part of a checkpoint
    load_shards(folder, meta)                       and back, resharding where it can

``DataParallelEngine`` is plain DDP over the dp axis, with Megatron TP inside each
replica when tp_size > 1. DeepSpeed ZeRO and pipeline stages provide their own.
"""

from __future__ import annotations

import abc
import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_trainer.config import Config
from dist_trainer.model import Transformer, build_model
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.grad import clip_grad_norm_, finalize_tp_grads
from dist_trainer.parallel.reshard import tp_shard_specs
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tensor_parallel import apply_tensor_parallel
from dist_trainer.train import checkpoint as ckpt
from dist_trainer.train.optim import build_optimizer, set_lr


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _counting_allreduce_hook(dp: AxisGroup, bucket):  # noqa: ANN001 - DDP rejects string annotations here
    """DDP's own all-reduce (mean over dp) of a dist.GradBucket, recorded in the communication counter."""
    buf = bucket.buffer()
    dp.counter.record("all_reduce", "dp", buf.numel() * buf.element_size())
    assert dp.group is not None, "DDP runs only over a dp group of more than one rank"
    return default_hooks.allreduce_hook(dp.group, bucket)


class Engine(abc.ABC):
    """The interface every regime implements (see the module docstring).

    Abstract, so a regime that forgets a call cannot be built, and the type checker holds every
    override to these signatures (``make test`` runs mypy): a drifted signature fails CI, not a user's run.
    """

    name: str = "engine"
    model: nn.Module  # this rank's module (its parameters are what this rank holds)

    @abc.abstractmethod
    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches of one step; the summed (detached) loss."""

    @abc.abstractmethod
    def optimizer_step(self, lr: float) -> torch.Tensor:
        """Finalize gradients, clip, step at ``lr`` and zero the gradients; the global grad norm."""

    @abc.abstractmethod
    def eval_loss(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The summed no-grad loss of ``batches``, the same on every rank of a model replica."""

    @abc.abstractmethod
    def save_shards(self, folder: Path) -> dict[str, Any]:
        """Write this rank's files into ``folder``; return what meta.json should record."""

    @abc.abstractmethod
    def load_shards(self, folder: Path, meta: dict[str, Any]) -> None:
        """Load this rank's part of the checkpoint in ``folder`` (saved under any layout it can reshard)."""


class NamedShardsMixin:
    """Checkpoint I/O for engines whose ``model`` names its parameters as the plain model does.

    One writer per (tp, pp) coordinate (dp rank 0) saves weights and optimizer state by
    name, and tp rank 0 of each stage the split specs that let another layout reshard them.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    state: ParallelState

    def save_shards(self, folder: Path) -> dict[str, Any]:
        if self.state.dp_rank == 0:  # DP replicas hold the same state: one writer per (tp, pp)
            optim_state = ckpt.optimizer_state_by_name(self.model, self.optimizer)
            if self.scaler is not None:
                optim_state["scaler"] = self.scaler.state_dict()
            model_state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            ckpt.atomic_save(model_state, folder / ckpt.shard_name("model", self.state.tp_rank, self.state.pp_rank))
            ckpt.atomic_save(optim_state, folder / ckpt.shard_name("optim", self.state.tp_rank, self.state.pp_rank))
            if self.state.tp_rank == 0:
                ckpt.write_specs(folder, self.state.pp_rank, tp_shard_specs(self.model))
        return {}

    def load_shards(self, folder: Path, meta: dict[str, Any]) -> None:
        model_state, optim_state = ckpt.load_shards(
            folder, meta, tp_rank=self.state.tp_rank, tp_size=self.state.tp_size, pp_rank=self.state.pp_rank,
            pp_size=self.state.pp_size, specs_now=tp_shard_specs(self.model))
        self.model.load_state_dict(model_state)
        ckpt.load_optimizer_state_by_name(self.model, self.optimizer, optim_state)
        if self.scaler is not None and "scaler" in optim_state:
            self.scaler.load_state_dict(optim_state["scaler"])


class DataParallelEngine(NamedShardsMixin, Engine):
    """DDP over the dp axis; Megatron TP (and SP) inside each replica when tp_size > 1."""

    def __init__(self, cfg: Config, state: ParallelState, device: torch.device) -> None:
        self.cfg = cfg
        self.state = state
        self.device = device
        self.name = "tp+ddp" if state.tp_size > 1 else "ddp"
        self.model = self._build_model()
        self.wrapped = self._wrap(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None

    def _build_model(self) -> Transformer:
        model = build_model(self.cfg.model, seed=self.cfg.train.seed)
        model.set_activation_checkpointing(self.cfg.parallel.activation_checkpointing,
                                           self.cfg.parallel.checkpoint_every)
        # Megatron TP: the full model is drawn from the seed, then each rank keeps its slices,
        # so every layout starts from the single-process weights.
        apply_tensor_parallel(model, self.state, self.cfg.parallel.sequence_parallel)
        return model.to(self.device)

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.state.dp_size == 1:
            return model
        ddp = DDP(model, process_group=self.state.dp.group,
                  device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  find_unused_parameters=model.pooler is not None)  # the pooler takes no part in the MLM loss
        ddp.register_comm_hook(self.state.dp, _counting_allreduce_hook)
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
                    loss = wrapped(batch["tokens"], batch["targets"])
                scaled = loss / n
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach().float()
        return loss_sum

    def optimizer_step(self, lr: float) -> torch.Tensor:
        finalize_tp_grads(self.model, self.state)  # partial grads of TP-replicated params (SP norms, ...)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        # Global norm over every rank's shards (TP-replicated params once), clipped if asked.
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = clip_grad_norm_(self.model, max_norm, self.state)
        set_lr(self.optimizer, lr)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    @torch.no_grad()
    def eval_loss(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with autocast_for(self.cfg.train.precision, self.device):
            for batch in batches:
                total += self.model(batch["tokens"], batch["targets"]).float()
        self.model.train()
        return total
