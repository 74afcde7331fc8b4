"""Engines: what a regime does inside the one training loop.

The Trainer owns data, the schedule of steps, metrics and checkpoint publication; an
engine owns the model, the optimizer and how one step's micro-batches become an update.
Every regime implements the same five calls, so the loop never branches on the regime:

    forward_backward(batches) -> summed loss        the step's micro-batches on this rank
    optimizer_step(lr) -> grad norm                 finalize grads, clip, step, zero grads
    eval_loss(batches) -> summed loss               no-grad forward
    save_shards(folder)                             this rank's part of a checkpoint
    load_shards(folder, meta)                       and back, resharding where it can

Inside ``optimizer_step`` every engine calls its ``step_hooks`` (``health/hooks.StepHooks``) at the same two
points: ``grads_ready()`` once the gradients are final (reduced, TP partial sums and tied copies summed; before
clipping), and ``allow_update(grad_norm)`` before the update, which it skips when the answer is no. The trainer's
health monitor (``health/monitor.py``) is the hooks: it reads the gradients and refuses a non-finite or spiking
step (issues 13 and 16). ``owned_pieces()`` says which elements of each full parameter this rank owns
(``parallel/ownership.py``), so such statistics are the full model's in every layout.

One module per regime implements them (``ddp.py``: DDP with Megatron TP inside each replica;
``pipeline.py``: stages on torch.distributed.pipelining with TP and DP around them; ``zero.py``:
DeepSpeed ZeRO-1/2/3), and ``engines/__init__.py`` maps a layout to its engine. What they share
is written once here: the seeded model, autocast, the clip-and-step, checkpoints by name.
"""

from __future__ import annotations

import abc
import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dist_trainer.checkpoint import publish
from dist_trainer.checkpoint.checkpoint_source import load_shards
from dist_trainer.checkpoint.convert import (
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    select_names,
    shard_name,
    write_specs,
)
from dist_trainer.checkpoint.load import load_owned_, materialize_
from dist_trainer.checkpoint.source import open_source
from dist_trainer.config import Config
from dist_trainer.finetune import frozen_modules
from dist_trainer.health.hooks import StepHooks
from dist_trainer.model import Transformer, build_model
from dist_trainer.model_lora import freeze_
from dist_trainer.optim import set_lr
from dist_trainer.parallel.compile import apply_compile
from dist_trainer.parallel.ep.apply import apply_expert_parallel
from dist_trainer.parallel.ep.grad import expert_param_names
from dist_trainer.parallel.ownership import Piece, dense_pieces
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.apply import apply_tensor_parallel
from dist_trainer.parallel.tp.reshard import tp_shard_specs
from dist_trainer.parallel.zero.memory import optimizer_moments, unique_bytes


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def seeded_model(cfg: Config, device: str = "cpu") -> Transformer:
    """The single-process model drawn from ``train.seed``, activation checkpointing set, ``train.freeze``
    applied: every regime's start (``train.init_from``'s weights come in once the model is cut to this rank)."""
    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    model.set_activation_checkpointing(cfg.parallel.activation_checkpointing, cfg.parallel.checkpoint_every)
    start_finetune(model, cfg)
    return model


def sharded_model(cfg: Config, state: ParallelState) -> Transformer:
    """``seeded_model`` cut to this rank: its TP slices (Megatron TP: the full model is drawn from the seed, then
    each rank keeps its slices, so every layout starts from the single-process weights) and its experts."""
    streamed = streams_start_weights(cfg)
    model = seeded_model(cfg, device="meta" if streamed else "cpu")
    apply_tensor_parallel(model, state, cfg.parallel.sequence_parallel)
    apply_expert_parallel(model, state)  # no-op at ep_size 1
    if streamed:
        materialize_(model)
    load_start_weights(model, cfg, state)
    if cfg.train.compile:
        apply_compile(model)
    return model


def streams_start_weights(cfg: Config) -> bool:
    """Whether every weight comes from ``train.init_from`` (adapters, which draw their own, aside): then a rank
    builds only its slices, uninitialised, and fills them from the source, so no rank ever holds the whole model
    (issue 21); with adapters the seed's model is drawn first."""
    return bool(cfg.train.init_from) and not cfg.model.lora_rank


def start_finetune(model: nn.Module, cfg: Config) -> None:
    """``train.freeze`` on whole modules under the plain model's names (the seeded model, the pipeline rank's
    stages, a ZeRO-3 model) before TP splits them; the TP layers keep ``requires_grad``."""
    freeze_(model, frozen_modules(cfg.model, cfg.train.freeze))


def load_start_weights(model: nn.Module, cfg: Config, state: ParallelState) -> None:
    """``train.init_from``'s weights (a Hugging Face folder, an export or a checkpoint of any layout) into this
    rank's cut of the model: each parameter reads only the slice it owns (``checkpoint/load.py``); the model's
    adapters keep their draw."""
    if cfg.train.init_from:
        load_owned_(model, open_source(cfg.train.init_from), state.tp_rank, state.tp_size)


def clip_norm(cfg: Config) -> float:
    """The global-norm clip of ``optim.grad_clip`` (0 = no clipping, the norm is still measured)."""
    return cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")


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


class Engine(abc.ABC):
    """The interface every regime implements (see the module docstring).

    Abstract, so a regime that forgets a call cannot be built, and the type checker holds every
    override to these signatures (``make test`` runs mypy): a drifted signature fails CI, not a user's run.
    """

    name: str = "engine"
    model: nn.Module  # this rank's module (its parameters are what this rank holds)
    state: ParallelState
    step_hooks: StepHooks = StepHooks()  # the trainer installs its health monitor here

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

    def owned_pieces(self, grads: bool = True) -> list[Piece]:
        """The elements of each full parameter this rank owns (values and, with ``grads``, gradients, as flat
        views); the pieces of all ranks partition the model once. A regime that partitions otherwise (ZeRO)
        overrides it."""
        return dense_pieces(self.model, self.state)

    def owned_state_bytes(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: the bytes of model states this rank holds now, each storage once
        (gradients as they exist at the call: between backward and the optimizer step they are all there).
        What the planner's model-state terms predict; a regime with other holdings overrides it."""
        params = list(self.model.parameters())
        optimizer = getattr(self, "optimizer", None)
        return {"params": unique_bytes(params), "grads": unique_bytes(p.grad for p in params),
                "optimizer": 0 if optimizer is None else unique_bytes(optimizer_moments(optimizer))}


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


class DenseUpdateMixin:
    """The hooked update of engines that step a torch optimizer themselves (DDP, pipeline)."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    step_hooks: StepHooks

    def update_unless_vetoed(self, grad_norm: torch.Tensor, lr: float) -> None:
        """``apply_update`` at ``lr``, unless the step hooks refuse this step (then only drop the gradients)."""
        if self.step_hooks.allow_update(grad_norm):
            apply_update(self.optimizer, lr, self.scaler)
        else:
            drop_update(self.optimizer, self.scaler)


class NamedShardsMixin:
    """Checkpoint I/O for engines whose ``model`` names its parameters as the plain model does.

    One writer per (tp, pp) coordinate (dp rank 0) saves weights and optimizer state by
    name, and tp rank 0 of each stage the split specs that let another layout reshard them.
    Under expert parallelism the first rank of each edp group writes: ep rank 0 everything it
    holds, ep rank e > 0 its experts alone (by global name) into ``*_epEE`` files.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    state: ParallelState

    def save_shards(self, folder: Path) -> dict[str, Any]:
        if self.state.edp.rank == 0:  # DP replicas hold the same state: one writer per (tp, pp, ep)
            optim_state = optimizer_state_by_name(self.model, self.optimizer)
            if self.scaler is not None:
                optim_state["scaler"] = self.scaler.state_dict()
            model_state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            write_named_shards(folder, self.state, self.model, model_state, optim_state)
        return {}

    def load_shards(self, folder: Path, meta: dict[str, Any]) -> None:
        model_state, optim_state = load_shards(
            folder, meta, tp_rank=self.state.tp_rank, tp_size=self.state.tp_size, pp_rank=self.state.pp_rank,
            pp_size=self.state.pp_size, specs_now=tp_shard_specs(self.model), ep_size=self.state.ep_size)
        self.model.load_state_dict(model_state)
        load_optimizer_state_by_name(self.model, self.optimizer, optim_state)
        if self.scaler is not None and "scaler" in optim_state:
            self.scaler.load_state_dict(optim_state["scaler"])
