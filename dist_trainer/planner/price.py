"""Pricing one candidate of the search: the worst rank's memory and the step time, with what many candidates
share (parameters per (tp, pp, rank, ep), activation costs per spec, the stage split per (pp, virtual stages))
computed once per model and batch shape."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, fields
from typing import cast

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import Layout
from dist_trainer.planner import activations as act
from dist_trainer.planner.activation_costs import OFFLOADED, LayerCosts, layer_costs, stage_activations
from dist_trainer.planner.compute import step_model_flops
from dist_trainer.planner.cost import StepTime, estimate_step_time
from dist_trainer.planner.finetune import grad_plan
from dist_trainer.planner.hardware import HardwareProfile
from dist_trainer.planner.memory import (
    Overheads,
    RankMemory,
    TrainingOptions,
    activation_spec,
    layout_rank_params,
    node_host_bytes,
    rank_expert_trainable,
    rank_states,
    rank_trainable,
    seq2seq_activation_bytes,
    spec_fields,
    with_activations,
    with_loss_chunk,
)
from dist_trainer.planner.rank_params import RankParams

# what decides a rank's memory but its activations: every Layout field but the recomputation's
_BUT_RECOMPUTATION = operator.attrgetter(*(f.name for f in fields(Layout)
                                           if f.name not in ("activation_checkpointing", "checkpoint_every",
                                                             "activation_offload")))


@dataclass(frozen=True)
class PlannedLayout:
    layout: Layout
    memory: RankMemory  # the rank with the most device bytes (first or last pipeline stage)
    time: StepTime
    fits: bool  # in the GPU memory and, for offloaded states, in the node's host memory
    host_per_node: int = 0  # host bytes of the ranks one node holds (offloaded states)
    loss_chunk_tokens: int = 0  # the model.loss_chunk_tokens it was priced with (the planner's choice or the model's)

    def to_dict(self) -> dict[str, object]:
        return {"layout": self.layout.__dict__, "memory": self.memory.to_dict(), "time": self.time.to_dict(),
                "fits": self.fits, "host_per_node": self.host_per_node, "loss_chunk_tokens": self.loss_chunk_tokens}


class Measured:
    """A candidate's memory before its step time: the search times only those it reports. ``device_total`` is
    known at once; ``memory``, the worst rank's whole report, is assembled when asked for (most candidates are
    judged on their total alone)."""

    def __init__(self, layout: Layout, worst: tuple[RankMemory, dict[str, int]], device_total: int, fits: bool,
                 host_per_node: int, overheads: Overheads) -> None:
        self.layout, self.fits, self.host_per_node, self.device_total = layout, fits, host_per_node, device_total
        self._worst, self._overheads = worst, overheads

    @functools.cached_property
    def memory(self) -> RankMemory:
        """The rank with the most device bytes (``memory.with_activations``)."""
        return with_activations(*self._worst, self._overheads)


class Pricer:
    """Caches per (tp, pp) parameters and per activation spec costs for one model and batch shape;
    ``choose_loss_chunk``: each layout priced with the loss chunk the planner chooses for it
    (``memory.with_loss_chunk``), else with the model's."""

    def __init__(self, cfg: ModelConfig, seq_len: int, options: TrainingOptions, overheads: Overheads,
                 hw: HardwareProfile, gpus_per_node: int, memory: int, host_memory: int,
                 choose_loss_chunk: bool = False) -> None:
        self.cfg, self.seq_len, self.options, self.overheads = cfg, seq_len, options, overheads
        self.choose_loss_chunk = choose_loss_chunk
        self._models: dict[tuple[object, ...], ModelConfig] = {}
        self.hw, self.gpus_per_node, self.memory, self.host_memory = hw, gpus_per_node, memory, host_memory
        self._params: dict[tuple[int, int, int, int, int], RankParams] = {}
        self._costs: dict[tuple[object, ...], LayerCosts] = {}
        self._layers: dict[tuple[int, int], list[list[int]]] = {}
        self._states: dict[tuple[tuple[object, ...], int], RankMemory] = {}
        self._worst: dict[tuple[int, int], list[int]] = {}
        self._acts: dict[tuple[tuple[object, ...], int], dict[str, int]] = {}
        self._flops: dict[tuple[int, str, int, int], tuple[float, float]] = {}

    def model(self, layout: Layout) -> ModelConfig:
        """The model ``layout`` is priced with: the loss chunk chosen for its spec and tokens, or ``cfg``."""
        return self._spec(layout)[2]

    def _spec(self, layout: Layout) -> tuple[tuple[object, ...], int, ModelConfig]:
        """``layout``'s activation spec fields, a micro-batch's tokens on one rank and ``model(layout)``."""
        spec, tokens = spec_fields(layout), layout.rank_tokens(self.seq_len)
        if not self.choose_loss_chunk:
            return spec, tokens, self.cfg
        model = self._models.get((spec, tokens))
        if model is None:
            model = self._models[spec, tokens] = with_loss_chunk(self.cfg, layout, seq_len=self.seq_len,
                                                                 options=self.options)
        return spec, tokens, model

    def params(self, layout: Layout, rank: int) -> RankParams:
        key = (layout.tp_size, layout.pp_size, layout.pp_virtual_stages, rank, layout.ep_size)
        if key not in self._params:
            self._params[key] = layout_rank_params(self.cfg, layout, rank)
        return self._params[key]

    def layer_ids(self, layout: Layout) -> list[list[int]]:
        """Per pipeline rank, the global layers it holds (the trainer's split, layout_rules.layers_per_stage)."""
        key = (layout.pp_size, layout.pp_virtual_stages)
        if key not in self._layers:
            self._layers[key] = layout.layers_by_rank(self.cfg)
        return self._layers[key]

    def flops(self, layout: Layout) -> tuple[float, float]:
        """``compute.step_model_flops``: once per global batch and recomputation (all a step's FLOPs depend on)."""
        model = self.model(layout)
        key = (layout.global_batch_size, layout.activation_checkpointing, layout.checkpoint_every,
               model.loss_chunk_tokens)
        if key not in self._flops:
            self._flops[key] = step_model_flops(model, layout, seq_len=self.seq_len, options=self.options)
        return self._flops[key]

    def worst_candidates(self, layout: Layout) -> list[int]:
        """The pipeline ranks that may hold the most bytes (``memory_of``), once per stage split."""
        key = (layout.pp_size, layout.pp_virtual_stages)
        if key not in self._worst:
            layers, p = self.layer_ids(layout), layout.pp_size
            most = max(range(p), key=lambda r: (len(layers[r]), -r))
            self._worst[key] = sorted({0, most, p - 1})
        return self._worst[key]

    def costs(self, layout: Layout) -> LayerCosts:
        """Per-token activation costs, once per activation spec (every Layout field it declares)."""
        spec, _, model = self._spec(layout)
        key = (spec, model.loss_chunk_tokens)
        if key not in self._costs:
            self._costs[key] = layer_costs(model, activation_spec(layout, self.seq_len, self.options),
                                           grad_plan(self.cfg, self.options.freeze))
        return self._costs[key]

    def states(self, layout: Layout, rank: int) -> RankMemory:
        """``memory.rank_states`` of pipeline rank ``rank``: once for every recomputation mode of a layout."""
        return self._rank_states(layout, rank, _BUT_RECOMPUTATION(layout))

    def _rank_states(self, layout: Layout, rank: int, key: tuple[object, ...]) -> RankMemory:
        states = self._states.get((key, rank))
        if states is None:
            states = self._states[key, rank] = rank_states(
                self.cfg, layout, self.params(layout, rank), seq_len=self.seq_len, options=self.options,
                overheads=self.overheads, pp_rank=rank)
        return states

    def stage_acts(self, layout: Layout, r: int) -> dict[str, int]:
        """Pipeline rank ``r``'s activation terms (``memory.stage_activation_bytes``)."""
        return self._stage_acts(layout, r, self._acts_key(layout))

    def _acts_key(self, layout: Layout) -> tuple[object, ...] | None:
        """What a layout's activation terms depend on but the pipeline rank (None: an encoder-decoder's, not cached):
        the same for every layout of this spec, split and recomputation (ZeRO's stages, ep, ...). It begins with
        the costs' key (``costs``) and the tokens of a micro-batch on one rank."""
        if self.cfg.encoder_decoder:
            return None
        spec, tokens, model = self._spec(layout)
        p = layout.pp_size
        return (spec, model.loss_chunk_tokens, tokens, layout.activation_checkpointing, layout.checkpoint_every,
                layout.activation_offload, p, layout.pp_virtual_stages,
                layout.pp_schedule if p > 1 else None, layout.n_microbatches if p > 1 else None)

    def _stage_acts(self, layout: Layout, r: int, key: tuple[object, ...] | None) -> dict[str, int]:
        p = layout.pp_size

        def in_flight() -> float:
            return 1.0 if p == 1 else act.in_flight_microbatches(
                layout.pp_schedule, pp_size=p, pp_rank=r, n_microbatches=layout.n_microbatches,
                virtual_stages=layout.pp_virtual_stages)

        if key is None:  # both stacks' tokens (planner/seq2seq.py)
            return seq2seq_activation_bytes(self.cfg, layout, activation_spec(layout, self.seq_len, self.options),
                                            self.options, r, in_flight())
        # the micro-batches in flight follow from the schedule and the count, computed on a miss
        acts = self._acts.get((key, r))
        if acts is None:
            costs, tokens = self._costs.get(key[:2]), cast(int, key[2])  # as _acts_key begins
            acts = self._acts[key, r] = stage_activations(
                self.costs(layout) if costs is None else costs, mode=layout.activation_checkpointing,
                every=layout.checkpoint_every,
                layer_ids=self.layer_ids(layout)[r], tokens=tokens, first=r == 0, last=r == p - 1,
                in_flight=in_flight(), offload=layout.activation_offload)
        return acts

    def memory_of(self, layout: Layout) -> RankMemory:
        """The worst rank: the first (most micro-batches in flight, embeddings), the last (head and logits), or the
        first of those holding the most layers when the split is uneven (layout_rules puts the extra layers on
        the middle stages)."""
        _, worst, _ = self._worst_ranks(layout)
        return with_activations(*worst, self.overheads)

    def _worst_ranks(self, layout: Layout) -> tuple[int, tuple[RankMemory, dict[str, int]], int]:
        """The worst rank's device total and (states, activation terms) (``memory_of``), and the most host bytes of
        those ranks (offloaded states and activations: activation offload holds most on the first, whose
        micro-batches in flight are the most, not always the worst rank)."""
        host = 0
        worst: tuple[int, RankMemory, dict[str, int]] | None = None
        acts_key, states_key = self._acts_key(layout), _BUT_RECOMPUTATION(layout)
        for r in self.worst_candidates(layout):
            acts = self._stage_acts(layout, r, acts_key)
            states = self._rank_states(layout, r, states_key)
            # with_activations' device total, without building the rank's whole report
            offloaded = acts.get(OFFLOADED, 0)  # host bytes, not the device's
            held = states.model_states + sum(acts.values()) - offloaded + states.step_buffers
            total = held + states.overheads + round(self.overheads.fragmentation * held)
            host = max(host, states.host + offloaded)
            if worst is None or total > worst[0]:
                worst = (total, states, acts)
        assert worst is not None
        return worst[0], (worst[1], worst[2]), host

    def measure(self, layout: Layout) -> Measured:
        """The worst rank's memory and whether the layout fits (GPU and, for offloaded states, host memory)."""
        total, worst, most = self._worst_ranks(layout)
        host = node_host_bytes(most, world_size=layout.world_size, gpus_per_node=self.gpus_per_node)
        return Measured(layout, worst, total, total <= self.memory and host <= self.host_memory, host, self.overheads)

    def price(self, measured: Measured) -> PlannedLayout:
        """``measured`` with its step time (the search times only the layouts it reports)."""
        layout = measured.layout
        rp = self.params(layout, 0)
        model = self.model(layout)
        t = estimate_step_time(model, layout, seq_len=self.seq_len, hardware=self.hw,
                               gpus_per_node=self.gpus_per_node, options=self.options,
                               n_params_rank=rp.total, n_trainable_rank=rank_trainable(self.cfg, layout, rp,
                                                                                      self.options, 0),
                               n_expert_rank=rp.expert,
                               n_expert_trainable_rank=rank_expert_trainable(self.cfg, layout, rp, self.options, 0),
                               layers_by_rank=self.layer_ids(layout), flops=self.flops(layout),
                               offloaded=self.stage_acts(layout, 0).get(OFFLOADED, 0))
        return PlannedLayout(layout, measured.memory, t, measured.fits, measured.host_per_node,
                             model.loss_chunk_tokens)
