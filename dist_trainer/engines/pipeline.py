"""The pipeline regime inside the trainer: this rank's stages, a pipelining schedule, DP and TP around it.

``PipelineEngine`` builds only this rank's stages (``parallel/pipeline/split.py``), applies TP to
each, and runs the step through the ``torch.distributed.pipelining`` schedule named by
``parallel.pp_schedule`` (``parallel/pipeline/schedule.py``). What the library does not do for
this model happens here: the gradient average over dp (one flat all-reduce, counted; expert-parallel
experts over their edp group), the tied embedding's gradient sum between first and last stage, the
global grad norm over all stages, the loss broadcast from the last stage so every rank reports the
same value (plus the MoE router losses of every stage), and checkpoints under the plain model's
parameter names (so they reload at any tp x pp x ep).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dist_trainer.config import Config
from dist_trainer.engines.base import (
    DenseUpdateMixin,
    Engine,
    NamedShardsMixin,
    autocast_for,
    clip_norm,
    load_start_weights,
    start_finetune,
    streams_start_weights,
)
from dist_trainer.engines.deepspeed_zero import DeepSpeedZero
from dist_trainer.layout_rules import n_microbatches
from dist_trainer.model import seq2seq_inputs
from dist_trainer.model_moe import aux_loss_sum
from dist_trainer.model_names import (
    DECODER_FIRST_MODULES,
    ENCODER_LAST_MODULES,
    FIRST_STAGE_MODULES,
    LAST_STAGE_MODULES,
)
from dist_trainer.optim import build_optimizer
from dist_trainer.parallel.ep.apply import apply_expert_parallel
from dist_trainer.parallel.ep.grad import reduce_expert_grads, split_expert_grads
from dist_trainer.parallel.ownership import Piece
from dist_trainer.parallel.pipeline.schedule import build_schedule
from dist_trainer.parallel.pipeline.split import StageModule, split_into_stages, stage_placement
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.apply import apply_tensor_parallel
from dist_trainer.parallel.tp.grad import finalize_tp_grads
from dist_trainer.parallel.zero.config import validate_zero_config
from dist_trainer.parallel.zero.deepspeed import DeepSpeedMpu, prepare_for_deepspeed, quiet_deepspeed


class PipelineRankModule(nn.Module):
    """This rank's stages under the plain model's names: ``layers.{global index}``, ``tok_emb``, ...

    Only for naming (optimizer groups, checkpoints, resharding); the schedule runs the stages.
    A tied head on the last stage is its own ``tok_emb`` copy, named like the original.
    """

    def __init__(self, stages: list[StageModule]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name in FIRST_STAGE_MODULES + LAST_STAGE_MODULES + ENCODER_LAST_MODULES + DECODER_FIRST_MODULES:
                module = getattr(stage.model, name, None)
                if module is not None and not hasattr(self, name):
                    setattr(self, name, module)
            for i, layer in zip(stage.layer_ids, stage.model.layers):
                self.layers[str(i)] = layer
            for i, layer in zip(stage.layer_ids[len(stage.model.layers):], stage.model.dec_layers or ()):
                if not hasattr(self, "dec_layers"):  # an encoder-decoder's decoder layers: dec_layers.{j}
                    self.dec_layers = nn.ModuleDict()
                self.dec_layers[str(i - stage.model.cfg.n_layers)] = layer


class PipelineEngine(DenseUpdateMixin, NamedShardsMixin, Engine):
    def __init__(self, cfg: Config, state: ParallelState, device: torch.device) -> None:
        p = cfg.parallel
        self.cfg, self.state, self.device = cfg, state, device
        self.scaler = None
        self.n_micro = n_microbatches(p, state.dp_size)
        self.stages = split_into_stages(cfg.model, state.pp_size, state.pp_rank, virtual_stages=p.pp_virtual_stages,
                                        balance=p.pp_balance, stage_layers=p.pp_stage_layers,
                                        seed=cfg.train.seed, device="cpu", draw=not streams_start_weights(cfg))
        start_finetune(PipelineRankModule(self.stages), cfg)  # by global names, before TP splits the modules
        for stage in self.stages:
            apply_tensor_parallel(stage.model, state, p.sequence_parallel)
            apply_expert_parallel(stage.model, state)
            stage.set_activation_checkpointing(p.activation_checkpointing, p.checkpoint_every)
        load_start_weights(PipelineRankModule(self.stages), cfg, state)  # each rank its stages' TP slices
        for stage in self.stages:
            stage.to(device)
        self.pipe = build_schedule(self.stages, state, self.n_micro, p.pp_schedule, self.stages[-1].model.loss)
        placement = stage_placement(state.pp_size, p.pp_virtual_stages)
        last = state.pp_size * p.pp_virtual_stages - 1
        self.last_stage_rank = next(r for r, owned in enumerate(placement) if last in owned)
        self.model = PipelineRankModule(self.stages)
        self.zero = _zero_optimizer(cfg, state, device, self.model) if p.zero_stage else None
        self.optimizer = build_optimizer(self.model, cfg.optim) if self.zero is None else self.zero.optimizer
        self.name = f"pp[{p.pp_schedule}]" + ("+tp" if state.tp_size > 1 else "") + ("+dp" if state.dp_size > 1 else "")
        if self.zero is not None:
            self.name += f"+zero{p.zero_stage}"

    def _run(self, batches: list[dict[str, torch.Tensor]], train: bool) -> torch.Tensor:
        keys = ("tokens", *seq2seq_inputs(batches[0]))  # an encoder-decoder's first stage reads its decoder inputs too
        inputs = tuple(torch.cat([b[k] for b in batches]) for k in keys) if self.pipe.has_first_stage else None
        targets = torch.cat([b["targets"] for b in batches]) if self.pipe.has_last_stage else None
        stage_ids = [s.stage_index for s in self.stages]
        aux_before = aux_loss_sum(self.model)
        try:  # the schedule's send/recv are the library's: numbered on the pp axis for a hang report
            with autocast_for(self.cfg.train.precision, self.device), self.state.pp.exchange("pipeline send/recv"):
                if train:
                    loss = self.pipe.step(inputs, targets)
                else:
                    losses: list[torch.Tensor] = []
                    args = inputs or ()
                    self.pipe.schedule.eval(*args, target=targets, losses=losses)
                    loss = torch.stack([x.detach() for x in losses]).mean() if losses else None
        except RuntimeError as exc:  # a dead or stalled neighbour: say which stage waited on whom
            raise RuntimeError(
                f"pipeline stage(s) {stage_ids} on rank {self.state.rank} (pp rank {self.state.pp_rank}) failed "
                f"while exchanging activations with a neighbouring stage (timeout "
                f"parallel.timeout_s={self.cfg.parallel.timeout_s:g}s): {exc}") from exc
        out = torch.zeros((), device=self.device) if loss is None else loss.detach().float().reshape(())
        # the loss lives on the last stage: one broadcast so every rank reports the same figure
        self.state.pp.broadcast(out, src_axis_rank=self.last_stage_rank)
        if train and self.cfg.model.n_experts:  # each stage's router losses, mean over micro-batches, summed
            aux = torch.tensor((aux_loss_sum(self.model) - aux_before) / self.n_micro, device=self.device)
            out = out + self.state.pp.all_reduce(aux).to(out.dtype)
        return out * len(batches)

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        loss_sum = self._run(batches, train=True)
        # the gradient mean over dp, as DDP would, in one flat all-reduce (ZeRO reduces in its own step)
        if self.state.dp_size > 1 and self.zero is None:
            grads, _ = split_expert_grads(list(self.model.parameters()))  # experts: over edp, below
            self.state.dp.all_reduce_flat_(grads, divide_by=self.state.dp_size)
            reduce_expert_grads(self.model, self.state)
        return loss_sum

    def optimizer_step(self, lr: float) -> torch.Tensor:
        if self.zero is not None:  # partial TP grads were summed inside backward (prepare_for_deepspeed)
            self.pipe.finalize_grads()  # tied embedding: on the whole .grad, before ZeRO's dp reduction
            return self.zero.step(lr, self.step_hooks, reduce=True)
        for stage in self.stages:
            finalize_tp_grads(stage.model, self.state)
        self.pipe.finalize_grads()  # tied embedding: first-stage and last-stage copies get the summed gradient
        self.step_hooks.grads_ready()
        grad_norm = self.pipe.clip_grad_norm_(clip_norm(self.cfg), self.state)
        self.update_unless_vetoed(grad_norm, lr)
        return grad_norm

    @torch.no_grad()
    def eval_loss(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        for stage in self.stages:
            stage.eval()
        # one schedule pass per step's worth of micro-batches, so each evaluated micro-batch is a training step's
        # (a mean over its own target tokens: targets of different lengths, seq2seq pairs, make it matter)
        step = self.cfg.parallel.grad_accum_steps(self.state.dp_size)
        try:
            return sum((self._run(batches[i:i + step], train=False) for i in range(0, len(batches), step)),
                       torch.zeros((), device=self.device))
        finally:
            for stage in self.stages:
                stage.train()

    def owned_state_bytes(self) -> dict[str, int]:
        return super().owned_state_bytes() if self.zero is None else self.zero.owned_state_bytes()

    def owned_pieces(self, grads: bool = True) -> list[Piece]:
        return super().owned_pieces(grads) if self.zero is None else self.zero.pieces(grads)

    def save_shards(self, folder: Path) -> dict[str, Any]:
        return super().save_shards(folder) if self.zero is None else self.zero.save(folder)

    def load_shards(self, folder: Path, meta: dict[str, Any]) -> None:
        if self.zero is None:
            super().load_shards(folder, meta)
        else:
            self.zero.load(folder, meta)


def _zero_optimizer(cfg: Config, state: ParallelState, device: torch.device, model: nn.Module) -> DeepSpeedZero:
    """DeepSpeed's ZeRO-1 over this rank's stages (tagged after build_schedule marked the tied copy).

    DeepSpeed sees one micro-batch of the whole per-rank batch and no accumulation: the schedule accumulates the
    micro-batches in ``.grad`` itself (scaled by 1/n_micro), so each step is one DeepSpeed boundary. Its bf16/fp16
    sections are off: the stages keep fp32 parameters under autocast, as without ZeRO.
    """
    quiet_deepspeed()
    ds_config = {**validate_zero_config(cfg, state.dp_size, device.type),
                 "train_micro_batch_size_per_gpu": cfg.parallel.global_batch_size // state.dp_size,
                 "gradient_accumulation_steps": 1, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    mpu = DeepSpeedMpu(state)  # collective: every rank, once
    prepare_for_deepspeed(model, state)
    return DeepSpeedZero(cfg, state, model, ds_config, mpu)
