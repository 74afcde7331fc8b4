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

from dist_trainer.checkpoint.load import load_owned_
from dist_trainer.checkpoint.source import open_source
from dist_trainer.config import Config
from dist_trainer.engines.update import Update
from dist_trainer.facts.finetune import frozen_modules
from dist_trainer.health.hooks import StepHooks
from dist_trainer.model import Transformer, build_model
from dist_trainer.model_lora import freeze_
from dist_trainer.parallel.loss import TokenWeightedLoss
from dist_trainer.parallel.ownership import Piece
from dist_trainer.parallel.parallelize import parallelize
from dist_trainer.parallel.state import ParallelState


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def seeded_model(cfg: Config, device: str = "cpu") -> Transformer:
    """The single-process model drawn from ``train.seed``, ``train.freeze`` applied: every regime's start
    (``train.init_from``'s weights come in once the model is cut to this rank)."""
    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    start_finetune(model, cfg)
    return model


def sharded_model(cfg: Config, state: ParallelState, device: torch.device | str = "cpu") -> Transformer:
    """``seeded_model`` cut to this rank by ``parallelize`` (Megatron TP: the full model is drawn from the seed, then
    each rank keeps its slices, so every layout starts from the single-process weights; its experts; recompute;
    ``device``), then ``train.init_from``'s slices loaded."""
    streamed = streams_start_weights(cfg)
    model = parallelize(seeded_model(cfg, device="meta" if streamed else "cpu"), state.layout, state, device,
                        freeze=cfg.train.freeze, compile_blocks=cfg.train.compile)
    load_start_weights(model, cfg, state)
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


class Engine(abc.ABC):
    """The interface every regime implements (see the module docstring).

    Abstract, so a regime that forgets a call cannot be built, and the type checker holds every
    override to these signatures (``make test`` runs mypy): a drifted signature fails CI, not a user's run.
    """

    name: str = "engine"
    model: nn.Module  # this rank's module (its parameters are what this rank holds)
    state: ParallelState
    update: Update  # how its gradients become an update (engines/update.py)
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

    def loss_modules(self) -> list[TokenWeightedLoss]:
        """The token-weighted losses of this rank's model (``parallel/loss.py``)."""
        return [m for m in self.model.modules() if isinstance(m, TokenWeightedLoss)]

    def set_step_tokens(self, step_tokens: tuple[int, int] | None) -> None:
        """(covered targets of the coming step's global batch, the data-parallel ranks x micro-batches it is spread
        over), or None: each micro-batch's loss its own mean (``parallel/loss.py``)."""
        for module in self.loss_modules():
            module.step_tokens = step_tokens

    def save_shards(self, folder: Path) -> dict[str, Any]:
        """Write this rank's files into ``folder``; return what meta.json should record."""
        return self.update.save(folder)

    @property
    def async_checkpoints(self) -> bool:
        """Its checkpoint files go through ``publish.atomic_save``, so ``train.async_save`` can stage them."""
        return self.update.async_checkpoints

    def load_shards(self, folder: Path, meta: dict[str, Any]) -> None:
        """Load this rank's part of the checkpoint in ``folder`` (saved under any layout it can reshard)."""
        self.update.load(folder, meta)

    def owned_pieces(self, grads: bool = True) -> list[Piece]:
        """The elements of each full parameter this rank owns (values and, with ``grads``, gradients, as flat
        views); the pieces of all ranks partition the model once."""
        return self.update.pieces(grads)

    def owned_state_bytes(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: the bytes of model states this rank holds now, each storage once
        (gradients as they exist at the call: between backward and the optimizer step they are all there).
        What the planner's model-state terms predict."""
        return self.update.owned_state_bytes()
