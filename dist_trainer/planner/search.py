"""Enumerate every valid layout for N GPUs, drop those that do not fit, rank the rest by estimated step time.

The enumeration prunes early: model states depend only on (tp, pp, zero stage, offload), so when they alone
overflow the GPU the micro-batch, recomputation, SP and schedule loops are skipped (one minimal-activation
layout is still priced, to say how close it comes). Activation costs per token are computed once per (tp, sp)
and scaled, so a layout costs a few multiplications.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dist_trainer.config import CP_MODES, ZERO_STAGES, ModelConfig
from dist_trainer.config_load import config_from_dict
from dist_trainer.layout_rules import (
    MULTI_STAGE_SCHEDULES,
    Layout,
    check_ep,
    check_layout,
    check_layout_for,
    check_low_bit,
    check_tp,
    divisors,
)
from dist_trainer.planner import activations as act
from dist_trainer.planner.activation_costs import LayerCosts, layer_costs, stage_activations
from dist_trainer.planner.cost import StepTime, estimate_step_time
from dist_trainer.planner.emit import TRAIN_PRECISION, run_config_dict
from dist_trainer.planner.finetune import grad_plan
from dist_trainer.planner.hardware import HardwareProfile, get_hardware
from dist_trainer.planner.memory import (
    DEFAULT_OPTIONS,
    DEFAULT_OVERHEADS,
    Overheads,
    RankMemory,
    TrainingOptions,
    activation_spec,
    layout_rank_params,
    node_host_bytes,
    rank_expert_trainable,
    rank_memory,
    rank_trainable,
    seq2seq_activation_bytes,
)
from dist_trainer.planner.rank_params import RankParams
from dist_trainer.quant.sizes import check_int8_layout


@dataclass(frozen=True)
class PlannedLayout:
    layout: Layout
    memory: RankMemory  # the rank with the most device bytes (first or last pipeline stage)
    time: StepTime
    fits: bool  # in the GPU memory and, for offloaded states, in the node's host memory
    host_per_node: int = 0  # host bytes of the ranks one node holds (offloaded states)

    def to_dict(self) -> dict[str, object]:
        return {"layout": self.layout.__dict__, "memory": self.memory.to_dict(), "time": self.time.to_dict(),
                "fits": self.fits, "host_per_node": self.host_per_node}


@dataclass
class PlanResult:
    layouts: list[PlannedLayout]  # fitting layouts, fastest first
    closest: PlannedLayout | None  # when nothing fits: the layout with the fewest device bytes
    gpu_memory_bytes: int
    n_considered: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    host_memory_bytes: int = 0  # the host-memory budget per node that offload layouts were held to

    @property
    def best(self) -> PlannedLayout | None:
        return self.layouts[0] if self.layouts else None

    @property
    def over_by(self) -> int:
        """Bytes by which the closest layout exceeds the GPU memory (0 when something fits)."""
        if self.layouts or self.closest is None:
            return 0
        return self.closest.memory.device_total - self.gpu_memory_bytes


class _Skipped:
    """Why candidate layouts were not valid: per rule, the values that broke it (for the no-valid-layout note)."""

    def __init__(self) -> None:
        self.rules: dict[str, list[str]] = {}

    def add(self, rule: str, value: str) -> None:
        values = self.rules.setdefault(rule, [])
        if value not in values:
            values.append(value)

    def summary(self, most: int = 8) -> str:
        def values(vals: list[str]) -> str:
            return ", ".join(vals[:most]) + (f" and {len(vals) - most} more" if len(vals) > most else "")

        return "; ".join(f"{rule}: {values(vals)}" for rule, vals in self.rules.items())


class _Planner:
    """Caches per (tp, pp) parameters and per (tp, sp) activation costs for one model and batch shape."""

    def __init__(self, cfg: ModelConfig, seq_len: int, options: TrainingOptions, overheads: Overheads,
                 hw: HardwareProfile, gpus_per_node: int, memory: int, host_memory: int) -> None:
        self.cfg, self.seq_len, self.options, self.overheads = cfg, seq_len, options, overheads
        self.hw, self.gpus_per_node, self.memory, self.host_memory = hw, gpus_per_node, memory, host_memory
        self._params: dict[tuple[int, int, int, int, int], RankParams] = {}
        self._costs: dict[tuple[int, bool, int, int, str, int], LayerCosts] = {}
        self._layers: dict[tuple[int, int], list[list[int]]] = {}

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

    def costs(self, layout: Layout) -> LayerCosts:
        # the micro-batch shares per-sequence tensors (an (s, s) mask) among its sequences
        key = (layout.tp_size, layout.sequence_parallel, layout.ep_size, layout.cp_size, layout.cp_mode,
               layout.micro_batch_size)
        if key not in self._costs:
            self._costs[key] = layer_costs(self.cfg, activation_spec(layout, self.seq_len, self.options),
                                           grad_plan(self.cfg, self.options.freeze))
        return self._costs[key]

    def memory_of(self, layout: Layout) -> RankMemory:
        """The worst rank: the first (most micro-batches in flight, embeddings), the last (head and logits), or the
        first of those holding the most layers when the split is uneven (layout_rules puts the extra layers on
        the middle stages)."""
        p = layout.pp_size
        layers = self.layer_ids(layout)
        most = max(range(p), key=lambda r: (len(layers[r]), -r))
        worst: RankMemory | None = None
        for r in sorted({0, most, p - 1}):
            in_flight = 1.0 if p == 1 else act.in_flight_microbatches(
                layout.pp_schedule, pp_size=p, pp_rank=r, n_microbatches=layout.n_microbatches,
                virtual_stages=layout.pp_virtual_stages)
            if self.cfg.encoder_decoder:  # both stacks' tokens (planner/seq2seq.py)
                acts = seq2seq_activation_bytes(self.cfg, layout, activation_spec(layout, self.seq_len, self.options),
                                                self.options, r, in_flight)
            else:
                acts = stage_activations(self.costs(layout),
                                         mode=layout.activation_checkpointing, every=layout.checkpoint_every,
                                         layer_ids=layers[r],
                                         tokens=layout.rank_tokens(self.seq_len), first=r == 0,
                                         last=r == p - 1, in_flight=in_flight)
            mem = rank_memory(self.cfg, layout, self.params(layout, r), acts, seq_len=self.seq_len,
                              options=self.options, overheads=self.overheads, pp_rank=r)
            if worst is None or mem.device_total > worst.device_total:
                worst = mem
        assert worst is not None
        return worst

    def price(self, layout: Layout) -> PlannedLayout:
        mem = self.memory_of(layout)
        rp = self.params(layout, 0)
        t = estimate_step_time(self.cfg, layout, seq_len=self.seq_len, hardware=self.hw,
                               gpus_per_node=self.gpus_per_node, options=self.options,
                               n_params_rank=rp.total, n_trainable_rank=rank_trainable(self.cfg, layout, rp,
                                                                                      self.options, 0),
                               n_expert_rank=rp.expert,
                               n_expert_trainable_rank=rank_expert_trainable(self.cfg, layout, rp, self.options, 0),
                               layers_by_rank=self.layer_ids(layout))
        host = node_host_bytes(mem, world_size=layout.world_size, gpus_per_node=self.gpus_per_node)
        return PlannedLayout(layout, mem, t, mem.device_total <= self.memory and host <= self.host_memory, host)


def _refusal(check: Callable[..., object], *args: object, **kwargs: object) -> str | None:
    """The ValueError message of a rule check, or None when it passes."""
    try:
        check(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


def _ep_sizes(model: ModelConfig, dp: int) -> list[int]:
    """Expert-parallel degrees to try: 1, and for a MoE model every divisor of dp that divides the experts."""
    return [e for e in divisors(dp) if e == 1 or model.n_experts % e == 0] if model.n_experts else [1]


# Context parallelism is searched only while each rank keeps this many tokens of a sequence: below it the ring's
# transfers are no longer hidden behind the attention blocks (Megatron-core recommends cp from 8K tokens up)
MIN_CP_TOKENS = 4096


def _cp_choices(ranks: int, pp: int, seq_len: int, max_cp: int | None) -> list[tuple[int, str]]:
    """(cp, mode) candidates for ``ranks`` (= n_gpus / tp) ranks and pp stages: cp 1, and each divisor of the ranks
    left that keeps MIN_CP_TOKENS per rank (or up to ``max_cp`` when given), in both modes."""
    if ranks % pp:
        return [(1, "ring")]
    sizes = [c for c in divisors(ranks // pp) if c > 1 and (c <= max_cp if max_cp is not None
                                                           else seq_len // c >= MIN_CP_TOKENS)]
    return [(1, "ring"), *((c, m) for c in sizes for m in CP_MODES)]


def _schedules(pp: int, allowed: tuple[str, ...]) -> list[tuple[str, int]]:
    """(schedule, virtual stages) candidates: one chunk per rank, or two for the multi-stage (interleaved) ones;
    whether each runs is layout_rules' answer (``runnable``)."""
    if pp == 1:
        return [("1f1b", 1)]
    return [(s, 2 if s in MULTI_STAGE_SCHEDULES else 1) for s in allowed]


def runnable(model: ModelConfig, layout: Layout, *, seq_len: int,
             options: TrainingOptions = DEFAULT_OPTIONS) -> str | None:
    """None when the trainer runs ``layout``, else the reason it refuses it.

    The question is put to the trainer's own rules, on the Layout itself: ``layout_rules.check_layout_for``, which
    the trainer's pre-launch check asks of the Layout its config resolves to (``tests/test_layout_rules.py`` holds
    the two to agreement).
    """
    return _refusal(lambda: check_layout_for(model, layout, seq_len=seq_len, freeze=options.freeze,
                                             precision=TRAIN_PRECISION[options.precision], device_type=options.device,
                                             state_dtype=options.optim_state_dtype))


def config_check(model: ModelConfig, *, seq_len: int,
                 options: TrainingOptions = DEFAULT_OPTIONS) -> Callable[[Layout], str | None]:
    """The slow way to ask the same question as ``runnable``: build and validate the run config ``plan --out``
    would write for a layout and put it to the trainer's whole check (``layout_rules.check_layout``), as the search
    did before issue 26. ``plan_layouts(check=...)`` takes it to show both rank alike."""
    def check(layout: Layout) -> str | None:
        cfg = config_from_dict(run_config_dict(model, layout, seq_len=seq_len, options=options))
        return _refusal(lambda: check_layout(cfg, layout.world_size, options.device))
    return check


# The largest problem the planner takes: ten times the largest clusters and batches in use, so that the search
# (every divisor of the GPU count and of the per-DP batch) ends in seconds for any input.
MAX_GPUS = 1 << 20
MAX_GPUS_PER_NODE = 1024
MAX_GLOBAL_BATCH = 1 << 20  # sequences per step


def plan_layouts(model: ModelConfig, *, n_gpus: int, gpus_per_node: int, gpu_memory_bytes: int, seq_len: int,
                 global_batch: int, hardware: str | HardwareProfile = "A100-80GB",
                 options: TrainingOptions = DEFAULT_OPTIONS, overheads: Overheads = DEFAULT_OVERHEADS,
                 zero_stages: tuple[int, ...] = ZERO_STAGES, allow_offload: bool = True,
                 checkpointing: tuple[str, ...] = ("none", "selective", "every_k", "full"),
                 pp_schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b"), top_k: int | None = None,
                 tp_size: int | None = None, max_tp_size: int | None = None, pp_size: int | None = None,
                 host_memory_bytes: int | None = None, max_cp_size: int | None = None,
                 check: Callable[[Layout], str | None] | None = None) -> PlanResult:
    """Every layout of ``model`` on ``n_gpus`` that the trainer runs, the fitting ones ranked by estimated step time.

    Enumerated: tp dividing gpus_per_node (a TP group stays in a node), pp up to n_layers, dp = n_gpus/(tp*pp)
    dividing global_batch, ep dividing dp and the experts (MoE models), micro-batches dividing the per-DP batch;
    each layout is then put to the trainer's own rules (``runnable``: heads, MLP width and vocabulary under TP,
    the stage split, the schedule against its micro-batches, which regimes compose, the device) and only those
    it accepts are priced and ranked. What the user's cluster or code allows narrows it: ``tp_size`` (exactly)
    or ``max_tp_size``, ``pp_size`` (1: no pipeline), ``zero_stages``, ``allow_offload``. Fitting: the worst
    rank's device bytes within ``gpu_memory_bytes``, and a node's host bytes (``ranks per node`` x the rank's
    offloaded states) within
    ``host_memory_bytes``, by default the hardware's host memory per GPU x gpus_per_node. ``check``: the refusal
    of a candidate (default ``runnable``, the trainer's rules on the Layout; ``benchmarks/planner_speed.py`` passes
    the trainer's whole config check to show both rank alike).

    Fast by construction (issue 26): the rules are asked of the Layout once per shape (recomputation aside), the
    stage split once per (pp, virtual stages), parameter counts once per (tp, pp, rank, ep) and activation costs
    once per (tp, sp, ep); a candidate then costs a few multiplications.
    """
    start = time.perf_counter()
    model.validate()
    options.validate()
    for name, v in (("n_gpus", n_gpus), ("gpus_per_node", gpus_per_node), ("seq_len", seq_len),
                    ("global_batch", global_batch), ("gpu_memory_bytes", gpu_memory_bytes)):
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    for name, v, most in (("n_gpus", n_gpus, MAX_GPUS), ("gpus_per_node", gpus_per_node, MAX_GPUS_PER_NODE),
                          ("global_batch", global_batch, MAX_GLOBAL_BATCH)):
        if v > most:  # the search's work grows with the divisors of these: bounded for any input (issue 28)
            raise ValueError(f"{name}={v:,} is beyond the planner's maximum of {most:,}")
    if n_gpus > gpus_per_node and n_gpus % gpus_per_node:
        raise ValueError(f"n_gpus={n_gpus} is not a multiple of gpus_per_node={gpus_per_node}")
    if seq_len > model.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds model.max_seq_len={model.max_seq_len}")
    for name, limit in (("tp_size", tp_size), ("max_tp_size", max_tp_size), ("pp_size", pp_size)):
        if limit is not None and limit < 1:
            raise ValueError(f"{name}={limit} must be >= 1")
    # what no layout changes (the freeze patterns, the sequence length against the model), asked once as the
    # trainer's config check asks it
    config_from_dict(run_config_dict(model, Layout(), seq_len=seq_len, options=options)).validate()
    hw = get_hardware(hardware)
    ranks_per_node = min(gpus_per_node, n_gpus)
    host_memory = hw.host_memory_per_node(gpus_per_node) if host_memory_bytes is None else host_memory_bytes
    pl = _Planner(model, seq_len, options, overheads, hw, gpus_per_node, gpu_memory_bytes, host_memory)
    fitting: list[PlannedLayout] = []
    closest: PlannedLayout | None = None
    host_short: list[PlannedLayout] = []  # model states fit the GPU, offloaded states not the host memory
    skipped = _Skipped()
    considered = 0
    refused: dict[Layout, str | None] = {}  # runnable() per layout without recomputation (it decides nothing here)

    def why_not(key: Layout) -> str | None:
        if key not in refused:
            refused[key] = runnable(model, key, seq_len=seq_len, options=options) if check is None else check(key)
            if refused[key] is not None:
                skipped.add("refused by the trainer's pre-launch check (layout_rules)", str(refused[key]))
        return refused[key]

    for tp in ([tp_size] if tp_size else divisors(min(gpus_per_node, n_gpus))):
        if max_tp_size is not None and tp > max_tp_size:
            continue
        bad = [f"{k}={v}" for k, v in (("ranks_per_node", ranks_per_node), ("n_gpus", n_gpus)) if v % tp]
        if bad:  # a TP group stays inside a node
            skipped.add("tp must divide the ranks per node and n_gpus", f"tp={tp} ({', '.join(bad)})")
            continue
        tp_refused = _refusal(check_tp, model, tp) or _refusal(check_int8_layout, model, options.freeze, tp, 0)
        if tp_refused:
            skipped.add("tensor parallelism (layout_rules.check_tp, check_low_bit)", tp_refused)
            continue
        pps = [pp_size] if pp_size else divisors(n_gpus // tp)
        shapes = [(p, c, mode) for p in pps for c, mode in _cp_choices(n_gpus // tp, p, seq_len, max_cp_size)]
        for pp, cp, cp_mode in shapes:
            if pp > model.n_layers:
                skipped.add(f"every pipeline stage holds a layer: pp <= n_layers={model.n_layers}", f"pp={pp}")
                continue
            with_cp = ("*cp", f"*{cp}", f" cp={cp}") if cp > 1 else ("", "", "")
            if n_gpus % (tp * pp * cp):
                skipped.add(f"tp*pp{with_cp[0]} must divide n_gpus={n_gpus}", f"{tp}*{pp}{with_cp[1]}")
                continue
            dp = n_gpus // (tp * pp * cp)
            if global_batch % dp:
                skipped.add(f"dp = n_gpus/(tp*pp{with_cp[0]}) must divide global_batch={global_batch}",
                            f"dp={dp} (tp={tp} pp={pp}{with_cp[2]})")
                continue
            per_dp = global_batch // dp
            # fewer micro-batches than stages: only GPipe runs it (layout_rules.check_schedule), 1F1B cannot fill
            if pp > 1 and per_dp < pp and "gpipe" not in pp_schedules:
                skipped.add("pp needs at least pp micro-batches per DP rank (all schedules but gpipe)",
                            f"pp={pp} gets {per_dp} (dp={dp})")
                continue
            for zero, ep in ((z, e) for z in zero_stages for e in _ep_sizes(model, dp)):
                if zero > 0 and dp == 1:
                    continue  # ZeRO shards over DP: nothing to shard
                ep_refused = _refusal(check_ep, model, ep, dp, zero, options.freeze)  # the rule runnable() applies
                if ep_refused:
                    skipped.add("expert parallelism (layout_rules.check_ep)", ep_refused)
                    continue
                for offload in ((False, True) if zero > 0 and allow_offload else (False,)):
                    low_bit = _refusal(check_low_bit, model, options.freeze, tp_size=tp, zero_stage=zero,
                                       zero_offload=offload, ep_size=ep, state_dtype=options.optim_state_dtype)
                    if low_bit:  # the rule runnable() applies, before the model states are priced
                        skipped.add("low-bit storage (layout_rules.check_low_bit)", low_bit)
                        continue
                    base = Layout(tp_size=tp, pp_size=pp, dp_size=dp, zero_stage=zero, zero_offload=offload,
                                  ep_size=ep, cp_size=cp, cp_mode=cp_mode)
                    # Model states alone (micro-batch independent): prune when they overflow.
                    states = pl.memory_of(replace(base, micro_batch_size=1, n_microbatches=per_dp,
                                                  activation_checkpointing="full",
                                                  sequence_parallel=tp > 1))
                    considered += 1
                    if states.device_total <= gpu_memory_bytes and node_host_bytes(
                            states, world_size=n_gpus, gpus_per_node=gpus_per_node) > host_memory:
                        host_short.append(pl.price(replace(base, micro_batch_size=1, n_microbatches=per_dp,
                                                           activation_checkpointing="full", sequence_parallel=tp > 1)))
                        continue  # host bytes depend on the model states alone: no micro-batch can help
                    if states.device_total > gpu_memory_bytes:
                        cand = pl.price(replace(base, micro_batch_size=1, n_microbatches=per_dp,
                                                activation_checkpointing="full", sequence_parallel=tp > 1))
                        if closest is None or cand.memory.device_total < closest.memory.device_total:
                            closest = cand
                        continue
                    for mb in divisors(per_dp):
                        m = per_dp // mb
                        for sched, v in _schedules(pp, pp_schedules):
                            for sp in ((False, True) if tp > 1 else (False,)):
                                shape = replace(base, micro_batch_size=mb, n_microbatches=m, sequence_parallel=sp,
                                                pp_schedule=sched, pp_virtual_stages=v)
                                if why_not(shape) is not None:
                                    continue  # the trainer refuses it (whatever the recomputation): never ranked
                                for ck in checkpointing:
                                    every = 2 if ck == "every_k" else 1
                                    lay = shape if ck == "none" else replace(shape, activation_checkpointing=ck,
                                                                             checkpoint_every=every)
                                    considered += 1
                                    planned = pl.price(lay)
                                    if planned.fits:
                                        fitting.append(planned)
                                    elif closest is None or planned.memory.device_total < closest.memory.device_total:
                                        closest = planned
    # Equal times (DP communication hidden behind backward): prefer the simpler layout, then the smaller one.
    fitting.sort(key=lambda x: (round(x.time.total, 9), x.layout.zero_stage, x.layout.zero_offload,
                                x.layout.tp_size * x.layout.pp_size, x.memory.device_total))
    if top_k is not None:
        fitting = fitting[:top_k]
    notes = [] if fitting else _nothing_fits_notes(closest, host_short, skipped, gpu_memory_bytes, host_memory,
                                                   n_gpus=n_gpus, gpus_per_node=gpus_per_node)
    return PlanResult(fitting, None if fitting else closest, gpu_memory_bytes, considered,
                      time.perf_counter() - start, notes, host_memory)


def _nothing_fits_notes(closest: PlannedLayout | None, host_short: list[PlannedLayout], skipped: _Skipped,
                        memory: int, host_memory: int, *, n_gpus: int, gpus_per_node: int) -> list[str]:
    notes = []
    if closest is not None:
        over = closest.memory.device_total - memory
        notes.append(f"nothing fits in {memory / 2**30:.1f} GiB; closest: {closest.layout.describe()} needs "
                     f"{closest.memory.device_total / 2**30:.1f} GiB, over by {over / 2**30:.1f} GiB")
    if host_short:
        least = min(host_short, key=lambda p: p.host_per_node)
        notes.append(f"{len(host_short)} offload layouts fit the GPU memory but not the host memory of "
                     f"{host_memory / 2**30:,.0f} GiB per node (--host-memory-gb); the least needs "
                     f"{least.host_per_node / 2**30:,.0f} GiB per node: {least.layout.describe()}")
    if closest is None and not host_short:
        why = skipped.summary() or "the constraints exclude every layout"
        notes.append(f"no valid layout for {n_gpus} GPUs ({gpus_per_node} per node): {why}")
    return notes
