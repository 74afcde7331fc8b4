"""Pricing one candidate of the search: the worst rank's memory and the step time, with what many candidates
share (parameters per (tp, pp, rank, ep), activation costs per spec, the stage split per (pp, virtual stages))
computed once per model and batch shape."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, fields

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import Layout
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
    in_flight_of,
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
    judged on their total alone), and so is ``layout``: ``shape`` with its ``recomputation`` (mode, every and
    activation offload share), built for the few the search keeps. Slotted: the search makes one per candidate."""

    __slots__ = ("fits", "host_per_node", "device_total", "first_offloaded", "_shape", "_recomputation", "_states",
                 "_acts", "_overheads", "_layout", "_memory")

    def __init__(self, shape: Layout, recomputation: tuple[str, int, float], states: RankMemory,
                 acts: dict[str, int], device_total: int, fits: bool, host_per_node: int, first_offloaded: int,
                 overheads: Overheads) -> None:
        self.fits, self.host_per_node, self.device_total = fits, host_per_node, device_total
        self.first_offloaded = first_offloaded  # pipeline rank 0's activation bytes in host memory
        self._shape, self._recomputation, self._overheads = shape, recomputation, overheads
        self._states, self._acts = states, acts  # the worst rank's
        self._layout: Layout | None = None
        self._memory: RankMemory | None = None

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            changes = _recomputation(self._shape, *self._recomputation)
            self._layout = self._shape.derive(**changes) if changes else self._shape
        return self._layout

    @property
    def memory(self) -> RankMemory:
        """The rank with the most device bytes (``memory.with_activations``)."""
        if self._memory is None:
            self._memory = with_activations(self._states, self._acts, self._overheads)
        return self._memory


# a candidate rank's model states (memory.rank_states) with the sums measuring adds its activations to: (states,
# model states + step buffers, overheads, host bytes); and its activation terms with (terms, device bytes, host
# bytes)
_States = tuple[RankMemory, int, int, int]
_Acts = tuple[dict[str, int], int, int]


def _states_sums(states: RankMemory) -> _States:
    return states, states.model_states + states.step_buffers, states.overheads, states.host


def _acts_sums(acts: dict[str, int]) -> _Acts:
    offloaded = acts.get(OFFLOADED, 0)  # host bytes, not the device's
    return acts, sum(acts.values()) - offloaded, offloaded


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
        self._states: dict[tuple[object, ...], tuple[_States, ...]] = {}
        self._worst: dict[tuple[int, int], list[int]] = {}
        self._acts: dict[tuple[object, ...], dict[tuple[str, int, float], tuple[_Acts, ...]]] = {}
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

    def _states_of(self, shape: Layout, ranks: list[int]) -> tuple[_States, ...]:
        """``memory.rank_states`` of each of ``ranks``: once for every recomputation mode and offload share."""
        key = _BUT_RECOMPUTATION(shape)
        got = self._states.get(key)
        if got is None:
            got = self._states[key] = tuple(_states_sums(rank_states(
                self.cfg, shape, self.params(shape, r), seq_len=self.seq_len, options=self.options,
                overheads=self.overheads, pp_rank=r)) for r in ranks)
        return got

    def _acts_of(self, shape: Layout, ranks: list[int]) -> Callable[[str, int, float], tuple[_Acts, ...]]:
        """Each of ``ranks``' activation terms (``memory.stage_activation_bytes``) under a recomputation mode, its
        every and an offload share, cached (but an encoder-decoder's) for every layout of this spec, tokens, split
        and micro-batches in flight (ZeRO's stages, ep, ... alike)."""
        if self.cfg.encoder_decoder:  # both stacks' tokens (planner/seq2seq.py)
            def seq2seq(mode: str, every: int, offload: float) -> tuple[_Acts, ...]:
                layout = shape.derive(**_recomputation(shape, mode, every, offload))
                spec = activation_spec(layout, self.seq_len, self.options)
                return tuple(_acts_sums(seq2seq_activation_bytes(self.cfg, layout, spec, self.options, r,
                                                                 in_flight_of(layout, r))) for r in ranks)
            return seq2seq
        spec, tokens, model = self._spec(shape)
        p = shape.pp_size
        key = (spec, model.loss_chunk_tokens, tokens, p, shape.pp_virtual_stages,
               shape.pp_schedule if p > 1 else None, shape.n_microbatches if p > 1 else None)
        by_mode = self._acts.get(key)
        if by_mode is None:
            by_mode = self._acts[key] = {}
        # what a miss needs of the shape: its costs, each rank's layers, first, last and micro-batches in flight
        stages: list[tuple[LayerCosts, list[tuple[list[int], bool, bool, float]]]] = []

        def stage_terms(mode: str, every: int, offload: float) -> tuple[_Acts, ...]:
            got = by_mode.get((mode, every, offload))
            if got is None:
                if not stages:
                    layers = self.layer_ids(shape)
                    stages.append((self.costs(shape), [(layers[r], r == 0, r == p - 1, in_flight_of(shape, r))
                                                       for r in ranks]))
                costs, ranks_of = stages[0]
                got = by_mode[mode, every, offload] = tuple(_acts_sums(stage_activations(
                    costs, mode=mode, every=every, layer_ids=ids, tokens=tokens, first=first, last=last,
                    in_flight=in_flight, offload=offload)) for ids, first, last, in_flight in ranks_of)
            return got
        return stage_terms

    def measurer(self, shape: Layout) -> Callable[[str, int, float], Measured]:
        """``measure`` of ``shape`` under a recomputation mode, its every and an activation offload share (its own
        three ignored): what those layouts share (the candidate ranks' model states, where their activation terms
        are kept) found once. The worst rank: the first (most micro-batches in flight, embeddings), the last (head
        and logits), or the first of those holding the most layers when the split is uneven (layout_rules puts
        the extra layers on the middle stages); a layout's host bytes are the most of those ranks' (offloaded
        states and activations: activation offload holds most on the first, whose micro-batches in flight are the
        most, not always the worst rank)."""
        ranks = self.worst_candidates(shape)
        states_of, acts_of = self._states_of(shape, ranks), self._acts_of(shape, ranks)
        frag, overheads, world = self.overheads.fragmentation, self.overheads, shape.world_size

        def measure(mode: str, every: int, offload: float) -> Measured:
            host, device = 0, -1
            per_rank = acts_of(mode, every, offload)
            for (states, states_held, states_over, states_host), (acts, acts_held, offloaded) in zip(states_of,
                                                                                                 per_rank):
                # with_activations' device total, without building the rank's whole report
                held = states_held + acts_held
                total = held + states_over + round(frag * held)
                host = max(host, states_host + offloaded)
                if total > device:  # the first of the most
                    device, worst_states, worst_acts = total, states, acts
            most = node_host_bytes(host, world_size=world, gpus_per_node=self.gpus_per_node)
            return Measured(shape, (mode, every, offload), worst_states, worst_acts, device,
                            device <= self.memory and most <= self.host_memory, most, per_rank[0][2], overheads)
        return measure

    def measure(self, layout: Layout) -> Measured:
        """The worst rank's memory and whether the layout fits (GPU and, for offloaded states, host memory)."""
        return self.measurer(layout)(layout.activation_checkpointing, layout.checkpoint_every,
                                     layout.activation_offload)

    def memory_of(self, layout: Layout) -> RankMemory:
        """The worst rank's memory (``measurer``)."""
        return self.measure(layout).memory

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
                               offloaded=measured.first_offloaded)
        return PlannedLayout(layout, measured.memory, t, measured.fits, measured.host_per_node,
                             model.loss_chunk_tokens)


def _recomputation(shape: Layout, mode: str, every: int, offload: float) -> dict[str, object]:
    """The changes that make ``shape`` the layout of this recomputation and offload share (none where it is)."""
    if (mode, every, offload) == (shape.activation_checkpointing, shape.checkpoint_every, shape.activation_offload):
        return {}
    return {"activation_checkpointing": mode, "checkpoint_every": every, "activation_offload": offload}
