"""How a step's gradients become an update: one interface (``Update``), two implementations.

    DenseUpdate     our optimizer (optim.name), stepped here: TP partial gradients summed, expert gradients reduced
                    over edp, the regime's own finishing touch (the pipeline's tied embedding), the health hooks,
                    the global-norm clip, the step; checkpoints by parameter name
    DeepSpeedZero   (``deepspeed_zero.py``) DeepSpeed's ZeRO optimizer: its own reduction, clip, step and files

An engine holds one and never asks which (the pipeline engine runs under either: its own update or ZeRO-1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dist_trainer.checkpoint import publish
from dist_trainer.checkpoint.async_save import staging_active
from dist_trainer.checkpoint.checkpoint_source import load_shards
from dist_trainer.checkpoint.convert import (
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    select_names,
    shard_name,
    write_specs,
)
from dist_trainer.health.hooks import StepHooks
from dist_trainer.optim import set_lr
from dist_trainer.parallel.ep.grad import expert_param_names, reduce_expert_grads, split_expert_grads
from dist_trainer.parallel.int8 import int8_buffers
from dist_trainer.parallel.ownership import Piece, dense_pieces
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.grad import finalize_tp_grads
from dist_trainer.parallel.tp.reshard import tp_shard_specs
from dist_trainer.parallel.zero.memory import optimizer_moments, unique_bytes


def nothing() -> None:
    """No finishing touch: the default ``finalize`` of ``Update.step``."""


class Update(Protocol):
    """What an engine asks of its update (module docstring)."""

    optimizer: torch.optim.Optimizer
    async_checkpoints: bool  # its files are written through publish.atomic_save (train.async_save stages them)

    def after_backward(self) -> None:
        """Once per step, after the last micro-batch's backward: reduce what the regime left unreduced."""

    def step(self, lr: float, hooks: StepHooks, finalize: Callable[[], None] = nothing) -> torch.Tensor:
        """``finalize`` (the regime's own gradient step), the hooks, clip, step at ``lr``; the global grad norm."""

    def pieces(self, grads: bool = True) -> list[Piece]:
        """This rank's pieces of every parameter (``parallel/ownership.py``)."""

    def owned_state_bytes(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: the model-state bytes this rank holds now."""

    def save(self, folder: Path) -> dict[str, Any]:
        """This rank's files of a checkpoint; what meta.json records."""

    def load(self, folder: Path, meta: dict[str, Any]) -> None:
        """This rank's part of a checkpoint of any layout."""


def apply_update(optimizer: torch.optim.Optimizer, lr: float, scaler: torch.amp.GradScaler | None = None) -> None:
    """Step at ``lr`` (through the loss scaler when there is one), then drop the gradients."""
    set_lr(optimizer, lr)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def drop_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> None:
    """Do not step: drop the gradients (the loss scaler, which was unscaled, still updates its scale)."""
    if scaler is not None:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


class DenseUpdate:
    """``optim.name``'s optimizer over ``model`` (this rank's module, named as the plain model), stepped as DDP would.

    ``tp_modules``: the modules whose partial TP gradients are summed (the model, or each pipeline stage's);
    ``clip``: the global-norm clip at a max norm, returning the norm (the pipeline's leaves its tied head copy out);
    ``reduce_over_dp``: the gradients are not yet averaged over dp (the pipeline schedule's are not; DDP's are).
    """

    async_checkpoints = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState, *,
                 clip: Callable[[float], torch.Tensor], max_norm: float, tp_modules: Iterable[nn.Module] = (),
                 reduce_over_dp: bool = False, scaler: torch.amp.GradScaler | None = None) -> None:
        self.model, self.optimizer, self.state, self.scaler = model, optimizer, state, scaler
        self.clip, self.max_norm, self.reduce_over_dp = clip, max_norm, reduce_over_dp
        self.tp_modules = list(tp_modules) or [model]

    def after_backward(self) -> None:
        replicas = self.state.replicas  # the ranks holding the same parameters (layout_rules.REPLICA_AXES)
        if self.reduce_over_dp and replicas.size > 1:  # the mean over them, as DDP's, in one flat all-reduce
            grads, _ = split_expert_grads(list(self.model.parameters()))  # experts: over edp, in step()
            replicas.all_reduce_flat_(grads, divide_by=replicas.size)

    def step(self, lr: float, hooks: StepHooks, finalize: Callable[[], None] = nothing) -> torch.Tensor:
        for module in self.tp_modules:
            finalize_tp_grads(module, self.state)  # partial grads of TP-replicated params (SP norms, ...)
        reduce_expert_grads(self.model, self.state)  # expert-parallel experts over edp
        finalize()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        hooks.grads_ready()
        grad_norm = self.clip(self.max_norm)
        if hooks.allow_update(grad_norm):
            apply_update(self.optimizer, lr, self.scaler)
        else:
            drop_update(self.optimizer, self.scaler)
        return grad_norm

    def pieces(self, grads: bool = True) -> list[Piece]:
        return dense_pieces(self.model, self.state)

    def owned_state_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {"params": unique_bytes([*params, *int8_buffers(self.model)]),  # int8 base weights are buffers
                "grads": unique_bytes(p.grad for p in params),
                "optimizer": unique_bytes(optimizer_moments(self.optimizer))}

    def save(self, folder: Path) -> dict[str, Any]:
        """One writer per (tp, pp, ep) coordinate (the first rank of each edp group) saves weights and optimizer
        state by name; dp replicas hold the same state."""
        if self.state.replica_coordinate(expert=True)[0] == 0:  # the first of the ranks holding these experts
            optim_state = optimizer_state_by_name(self.model, self.optimizer)
            if self.scaler is not None:
                optim_state["scaler"] = self.scaler.state_dict()
            # staged (train.async_save): device tensors as they are, copied into pinned host buffers once
            model_state = {k: v.detach() if staging_active() else v.detach().cpu()
                           for k, v in self.model.state_dict().items()}
            write_named_shards(folder, self.state, self.model, model_state, optim_state)
        return {}

    def load(self, folder: Path, meta: dict[str, Any]) -> None:
        s = self.state
        model_state, optim_state = load_shards(folder, meta, tp_rank=s.tp_rank, tp_size=s.tp_size, pp_rank=s.pp_rank,
                                               pp_size=s.pp_size, specs_now=tp_shard_specs(self.model),
                                               ep_size=s.ep_size)
        self.model.load_state_dict(model_state)
        load_optimizer_state_by_name(self.model, self.optimizer, optim_state)
        if self.scaler is not None and "scaler" in optim_state:
            self.scaler.load_state_dict(optim_state["scaler"])


def write_named_shards(folder: Path, state: ParallelState, model: nn.Module, model_state: dict[str, torch.Tensor],
                       optim_state: dict[str, Any]) -> None:
    """Write one writer's by-name model and optimizer state (and, on tp rank 0, the split specs) as
    ``checkpoint/convert.py`` reads them; under expert parallelism ep rank e > 0 keeps its experts alone."""
    specs = tp_shard_specs(model)
    tp, pp, ep = state.tp_rank, state.pp_rank, state.ep.rank
    if ep > 0:  # the dense parameters are ep rank 0's to write
        experts = set(expert_param_names(model))
        model_state, optim_state = select_names(model_state, optim_state, experts)
        specs = {n: s for n, s in specs.items() if n in experts}
    # through publish.atomic_save, where every checkpoint file is written (one place to fail or test)
    publish.atomic_save(model_state, folder / shard_name("model", tp, pp, ep))
    publish.atomic_save(optim_state, folder / shard_name("optim", tp, pp, ep))
    if tp == 0:
        write_specs(folder, pp, specs, ep)
