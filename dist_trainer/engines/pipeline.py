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

import torch
from torch import nn

from dist_trainer.config import Config
from dist_trainer.engines.base import (
    Engine,
    autocast_for,
    clip_norm,
    load_start_weights,
    start_finetune,
    streams_start_weights,
)
from dist_trainer.engines.deepspeed_zero import DeepSpeedZero
from dist_trainer.engines.update import DenseUpdate, Update
from dist_trainer.facts.model_names import (
    DECODER_FIRST_MODULES,
    ENCODER_LAST_MODULES,
    FIRST_STAGE_MODULES,
    LAST_STAGE_MODULES,
)
from dist_trainer.model import Transformer, seq2seq_inputs
from dist_trainer.model_moe import aux_loss_sum
from dist_trainer.optim import build_optimizer
from dist_trainer.parallel.loss import TokenWeightedLoss
from dist_trainer.parallel.parallelize import parallelize
from dist_trainer.parallel.pipeline.schedule import PipelineSchedule, build_schedule
from dist_trainer.parallel.pipeline.split import StageModule, split_into_stages, stage_placement
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.zero.config import validate_zero_config
from dist_trainer.parallel.zero.deepspeed import DeepSpeedMpu, prepare_for_deepspeed, quiet_deepspeed


class PipelineRankModule(nn.Module):
    """This rank's stages under the plain model's names: ``layers.{global index}``, ``tok_emb``, ...

    Only for naming (optimizer groups, checkpoints, resharding); the schedule runs the stages.
    A tied head on the last stage is its own ``tok_emb`` copy, named like the original.
    """

    def __init__(self, stages: list[StageModule]) -> None:
        super().__init__()
        # the stages' models (a plain list: not submodules, so no name changes): what a plan check watches
        self.chunks: list[Transformer] = [stage.model for stage in stages]
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


class PipelineEngine(Engine):
    def __init__(self, cfg: Config, state: ParallelState, device: torch.device) -> None:
        layout = state.layout
        self.cfg, self.state, self.device = cfg, state, device
        self.n_micro = layout.n_microbatches
        self.stages = split_into_stages(cfg.model, layout.pp_size, state.pp_rank,
                                        virtual_stages=layout.pp_virtual_stages, balance=layout.pp_balance,
                                        stage_layers=None if layout.pp_stage_layers is None else
                                        list(layout.pp_stage_layers), seed=cfg.train.seed, device="cpu",
                                        draw=not streams_start_weights(cfg))
        start_finetune(PipelineRankModule(self.stages), cfg)  # by global names, before TP splits the modules
        for stage in self.stages:
            parallelize(stage.model, layout, state, device, first_layer=stage.first_layer, freeze=cfg.train.freeze,
                        compile_blocks=cfg.train.compile)
        load_start_weights(PipelineRankModule(self.stages), cfg, state)  # each rank its stages' TP slices
        self.pipe = build_schedule(self.stages, state, self.n_micro, layout.pp_schedule, self.stages[-1].model.loss)
        placement = stage_placement(layout.pp_size, layout.pp_virtual_stages)
        last = layout.pp_size * layout.pp_virtual_stages - 1
        self.last_stage_rank = next(r for r, owned in enumerate(placement) if last in owned)
        self.model = PipelineRankModule(self.stages)
        self.update = _build_update(cfg, state, device, self.model, self.pipe)
        self.optimizer = self.update.optimizer
        self.name = f"pp[{layout.pp_schedule}]" + ("+tp" if state.tp_size > 1 else "") + (
            "+dp" if state.dp_size > 1 else "") + (f"+zero{layout.zero_stage}" if layout.zero_stage else "")

    def _run(self, batches: list[dict[str, torch.Tensor]], train: bool) -> torch.Tensor:
        """The schedule over the sampler's micro-batches (``n_micro`` per pass: a step is one pass, the eval set
        several); the sum of their losses on every rank."""
        # an encoder-decoder's first stage reads its decoder inputs too; a packed batch's its segment ids
        keys = ("tokens", *seq2seq_inputs(batches[0]))
        stage_ids = [s.stage_index for s in self.stages]
        aux_before = aux_loss_sum(self.model)
        losses: list[torch.Tensor] = []
        try:  # the schedule's send/recv are the library's: numbered on the pp axis for a hang report
            with autocast_for(self.cfg.train.precision, self.device), self.state.pp.exchange("pipeline send/recv"):
                for i in range(0, len(batches), self.n_micro):
                    group = batches[i:i + self.n_micro]
                    losses += self.pipe.run([tuple(b[k] for k in keys) for b in group] if self.pipe.has_first_stage
                                            else None,
                                            [b["targets"] for b in group] if self.pipe.has_last_stage else None,
                                            train=train)
        except RuntimeError as exc:  # a dead or stalled neighbour: say which stage waited on whom
            raise RuntimeError(
                f"pipeline stage(s) {stage_ids} on rank {self.state.rank} (pp rank {self.state.pp_rank}) failed "
                f"while exchanging activations with a neighbouring stage (timeout "
                f"parallel.timeout_s={self.cfg.parallel.timeout_s:g}s): {exc}") from exc
        out = torch.stack(losses).float().mean() if losses else torch.zeros((), device=self.device)
        # the loss lives on the last stage: one broadcast so every rank reports the same figure
        self.state.pp.broadcast(out, src_axis_rank=self.last_stage_rank)
        if train and self.cfg.model.n_experts:  # each stage's router losses, mean over micro-batches, summed
            aux = torch.tensor((aux_loss_sum(self.model) - aux_before) / self.n_micro, device=self.device)
            out = out + self.state.pp.all_reduce(aux).to(out.dtype)
        return out * len(batches)

    def loss_modules(self) -> list[TokenWeightedLoss]:
        return [m for stage in self.stages for m in stage.model.modules() if isinstance(m, TokenWeightedLoss)]

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        loss_sum = self._run(batches, train=True)
        self.update.after_backward()  # the mean over dp, as DDP's (ZeRO reduces in its own step)
        return loss_sum

    def optimizer_step(self, lr: float) -> torch.Tensor:
        # the tied embedding: first-stage and last-stage copies get the summed gradient (on the whole .grad, before
        # ZeRO's dp reduction)
        return self.update.step(lr, self.step_hooks, finalize=self.pipe.finalize_grads)

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


def _build_update(cfg: Config, state: ParallelState, device: torch.device, model: nn.Module,
                  pipe: PipelineSchedule) -> Update:
    """``optim.name``'s optimizer over this rank's stages, or DeepSpeed's ZeRO-1 (tagged after build_schedule marked
    the tied copy).

    DeepSpeed sees one micro-batch of the whole per-rank batch and no accumulation: the schedule accumulates the
    micro-batches in ``.grad`` itself (scaled by 1/n_micro), so each step is one DeepSpeed boundary. Its bf16/fp16
    sections are off: the stages keep fp32 parameters under autocast, as without ZeRO.
    """
    if state.layout.zero_stage == 0:
        return DenseUpdate(model, build_optimizer(model, cfg.optim, tp=state.tp), state, max_norm=clip_norm(cfg),
                           clip=lambda max_norm: pipe.clip_grad_norm_(max_norm, state),
                           tp_modules=[s.model for s in pipe.stages], reduce_over_dp=True)
    quiet_deepspeed()
    ds_config = {**validate_zero_config(cfg, state.dp_size, device.type),
                 "train_micro_batch_size_per_gpu": cfg.parallel.global_batch_size // state.dp_size,
                 "gradient_accumulation_steps": 1, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    mpu = DeepSpeedMpu(state)  # collective: every rank, once
    prepare_for_deepspeed(model, state)
    return DeepSpeedZero(cfg, state, model, ds_config, mpu, grads_from_schedule=True)
