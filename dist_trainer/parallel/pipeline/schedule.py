"""Pipeline schedules on ``torch.distributed.pipelining``, over the pp process group.

``build_schedule`` wraps this rank's ``StageModule``s in ``PipelineStage``s (p2p on
``state.pp.group``) and picks the library schedule named by ``parallel.pp_schedule``:

    gpipe             ScheduleGPipe             all forwards, then all backwards (Huang et al. 2019)
    1f1b              Schedule1F1B              PipeDream-flush (Narayanan et al. 2021, section 2.2)
    interleaved_1f1b  ScheduleInterleaved1F1B   v model chunks per rank, bubble / v (same paper)
    zero_bubble       ScheduleInterleavedZeroBubble  split input/weight backward (Qi et al. 2024)

Whether a schedule can run a batch is ``layout_rules.check_schedule`` (pure arithmetic, before any group exists).
The library scales gradients by 1 / n_microbatches (``scale_grads=True``), so with a
per-micro-batch mean loss the gradient is that of the mean over the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule  # the schedules' common base

from dist_trainer.layout_rules import MULTI_STAGE_SCHEDULES, check_schedule
from dist_trainer.model_blocks import set_attrs
from dist_trainer.model_moe import paused_router_stats
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.pipeline.replay import StageAction
from dist_trainer.parallel.pipeline.split import StageModule
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.grad import clip_grad_norm_

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


def _embedding_group(state: ParallelState, pp_ranks: list[int]) -> AxisGroup | None:
    """The pp ranks of this rank's pp line that hold a copy of the token embedding (the first stage and, tied, the
    last), for summing their gradients.

    ``dist.new_group`` is collective over the world: every rank creates every line's group, in the mesh's order
    of the pp lines. A set that is the whole pp line reuses the pp group itself.
    """
    pp = state.pp_size
    if len(pp_ranks) < 2:
        return None
    if pp_ranks == list(range(pp)):
        return state.pp
    mine = tuple(state.pp.ranks[p] for p in pp_ranks)
    group = None
    for line in state.mesh.lines("pp"):
        members = [line[p] for p in pp_ranks]
        g = dist.new_group(members)
        if tuple(members) == mine:
            group = g
    if state.pp_rank not in pp_ranks:
        return None
    return AxisGroup("pp", len(pp_ranks), pp_ranks.index(state.pp_rank), group, mine, state.counter)


def token_embedding_ranks(stages: list[StageModule], pp_size: int) -> list[int]:
    """The pp ranks whose stages hold a copy of the token embedding (stage s runs on pp rank s % pp_size): the first
    stage, and the last when the head is tied (an encoder-decoder's too: its first stage embeds both stacks)."""
    last = stages[0].num_stages - 1
    return sorted({s % pp_size for s in (0, *([last] if stages[0].model.cfg.tie_embeddings else []))})


@dataclass
class PipelineSchedule:
    """The library schedule plus the two things it does not do for this model.

    ``step``: one forward/backward over the batch; the mean loss on the rank holding the
    last stage (None elsewhere). ``finalize_grads``: sum the tied embedding's gradients
    between the first and last stage (call after ``step``, before clipping).
    """

    schedule: _PipelineSchedule  # a torch.distributed.pipelining schedule
    stages: list[StageModule]
    pipeline_stages: list[PipelineStage]
    n_microbatches: int
    embedding_group: AxisGroup | None

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)

    @property
    def has_first_stage(self) -> bool:
        return any(s.is_first for s in self.stages)

    def step(self, inputs: torch.Tensor | tuple[torch.Tensor, ...] | None,
             targets: torch.Tensor | None) -> torch.Tensor | None:
        """One training step over a whole batch, cut here into ``n_microbatches`` (for callers that hold one batch;
        the trainer hands its sampler's micro-batches to ``run``). ``inputs`` (the tokens, or a tuple: an
        encoder-decoder's with its decoder ids and source mask) are read on the first stage's rank, targets on the
        last's; others may pass None."""
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        checks = [*((t, self.has_first_stage, "inputs") for t in inputs or ()),
                  (targets, self.has_last_stage, "targets")]
        for batch, needed, what in checks:
            if needed and batch is not None and batch.shape[0] % self.n_microbatches:
                raise RuntimeError(
                    f"{what} batch of shape {tuple(batch.shape)}: dim 0 is not divisible by "
                    f"n_microbatches={self.n_microbatches}"
                )
        n = self.n_microbatches
        per_mb = None if inputs is None else list(zip(*(t.tensor_split(n) for t in inputs), strict=True))
        losses = self.run(per_mb, None if targets is None else list(targets.tensor_split(n)), train=True)
        return torch.stack(losses).mean() if losses else None

    def run(self, inputs: list[tuple[torch.Tensor, ...]] | None, targets: list[torch.Tensor] | None, *,
            train: bool) -> list[torch.Tensor]:
        """One pass of the schedule over ``n_microbatches`` micro-batches as they are given (the sampler's: the
        batch is cut once), with backward when ``train``; the detached loss of each on the last stage's rank, else
        []. Each micro-batch's inputs (its tokens; an encoder-decoder's with its decoder ids and source mask) are
        read on the first stage's rank, targets on the last's.

        The library's ``step()``/``eval()`` take one whole batch and cut it again; this is their body without the
        cut (torch.distributed.pipelining's ``_step_microbatches``, the entry every schedule implements, after the
        per-step reset ``step()`` does: the stages' backward flag and runtime state)."""
        for what, mbs, needed in (("inputs", inputs, self.has_first_stage), ("targets", targets, self.has_last_stage)):
            if needed and (mbs is None or len(mbs) != self.n_microbatches):
                raise RuntimeError(f"the schedule runs n_microbatches={self.n_microbatches} micro-batches of "
                                   f"{what}, got {None if mbs is None else len(mbs)}")
        schedule = self.schedule
        had_backward = schedule._has_backward
        schedule._has_backward = had_backward and train
        losses: list[torch.Tensor] = []
        try:
            for stage in self.pipeline_stages:
                stage.has_backward = schedule._has_backward
                stage.clear_runtime_states()
            args = list(inputs) if self.has_first_stage and inputs is not None else None
            # return_outputs=False: the library would otherwise keep every micro-batch's logits on the last stage
            # until the step ends and concatenate them into one (batch, seq, vocab) tensor nobody reads (issue 26)
            schedule._step_microbatches(args, None, targets if self.has_last_stage else None,
                                        losses if self.has_last_stage else None, return_outputs=False)
        finally:
            schedule._has_backward = had_backward
        return [loss.detach() for loss in losses]

    def finalize_grads(self) -> None:
        if self.embedding_group is None:
            return
        # the embedding on the first stage, its head copy on the last: each rank holds one (stages on one rank share it)
        owner = next(s for s in self.stages if s.model.tok_emb is not None)
        weight = owner.model.tok_emb.weight
        if not weight.requires_grad:  # frozen (train.freeze names tok_emb on both stages, or LoRA): no gradient
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        self.embedding_group.all_reduce(weight.grad)

    def clip_grad_norm_(self, max_norm: float, state: ParallelState) -> torch.Tensor:
        """``grad.clip_grad_norm_`` over this rank's stages, the tied head copy left out of the norm.

        Call after ``finalize_grads``: the copy then holds the same gradient as stage 0's
        embedding, which the norm counts once; the copy is scaled by the same coefficient.
        """
        params = [p for s in self.stages for p in s.parameters()]
        norm = clip_grad_norm_(
            [p for p in params if not getattr(p, "pp_shared_copy", False)], max_norm, state)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if getattr(p, "pp_shared_copy", False) and p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm


def build_schedule(stages: list[StageModule], state: ParallelState, n_microbatches: int, schedule_name: str,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> PipelineSchedule:
    """Wrap ``stages`` (from ``split_into_stages`` for ``state.pp_rank``) in the named schedule.

    Apply tensor parallelism to each ``stage.model`` first, and pass the last stage's
    ``model.loss`` as ``loss_fn`` (the vocab-parallel one under TP). Collective: every rank
    of the world calls it (the tied-embedding groups are created here).
    """
    virtual = len(stages)
    check_schedule(state.pp_size, schedule_name, n_microbatches, n_microbatches, virtual)  # the name among them
    if virtual == 0:
        raise ValueError("build_schedule: no stages given for this rank")
    if state.pp_size == 1 and state.world_size > 1:
        raise ValueError("build_schedule needs pp_size > 1 in a multi-rank run (pp_size 1 runs the plain model)")
    device = next(stages[0].parameters()).device
    pipeline_stages = [
        PipelineStage(s, s.stage_index, s.num_stages, device, group=state.pp.group) for s in stages
    ]
    for ps, s in zip(pipeline_stages, stages):  # the library's shape-inference forward routes no real tokens
        set_attrs(ps, _forward_metadata_inference=_pausing_stats(ps._forward_metadata_inference, s))
    cls = SCHEDULES[schedule_name]
    if schedule_name in MULTI_STAGE_SCHEDULES:
        schedule = cls(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    else:
        schedule = cls(pipeline_stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    for s in stages:
        if s.model.tok_emb is not None and not any(t.is_first for t in stages):
            # the head copy is counted once (on stage 0) in the grad norm, as Megatron's
            # param_is_not_shared; marked here, after any TP rewrite replaced the Parameter
            set_attrs(s.model.tok_emb.weight, pp_shared_copy=True)
    group = _embedding_group(state, token_embedding_ranks(stages, state.pp_size))
    return PipelineSchedule(schedule, stages, pipeline_stages, n_microbatches, group)


def _pausing_stats(infer: Callable, stage: StageModule) -> Callable:
    """``infer`` (PipelineStage._forward_metadata_inference, run on the first step and after every switch between
    training and evaluation) with the stage's MoE router statistics paused."""
    def run(*args, **kwargs):
        with paused_router_stats(stage):
            return infer(*args, **kwargs)
    return run


def trace_actions(pipe: PipelineSchedule) -> list[StageAction]:
    """Record every compute action this rank's stages run from now on, in execution order.

    Wraps the ``PipelineStage`` instances' chunk methods (the schedules' only way to
    compute), so the trace is what ran, not what a schedule's IR says should run. Used by
    the schedule-order tests and benchmarks/pipeline_bubble.py.
    """
    trace: list[StageAction] = []
    for stage in pipe.pipeline_stages:
        def wrap(fn: Callable, kind_of: Callable[[dict], str], index: int = stage.stage_index) -> Callable:
            def run(chunk: int, *args, **kwargs):
                start = time.perf_counter()
                out = fn(chunk, *args, **kwargs)
                trace.append(StageAction(index, kind_of(kwargs), chunk, start, time.perf_counter()))
                return out
            return run

        set_attrs(stage, forward_one_chunk=wrap(stage.forward_one_chunk, lambda kw: "F"),
                  backward_one_chunk=wrap(stage.backward_one_chunk,
                                          lambda kw: "B" if kw.get("full_backward", True) else "I"),
                  backward_weight_one_chunk=wrap(stage.backward_weight_one_chunk, lambda kw: "W"))
    return trace


def peak_in_flight(trace: list[StageAction], stage: int) -> int:
    """Most micro-batches of ``stage`` forwarded and not yet done backward (B, or W after I) at once."""
    held, peak = 0, 0
    for action in trace:
        if action.stage != stage:
            continue
        held += {"F": 1, "B": -1, "W": -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak
