"""Every layout for N GPUs that the trainer runs, those that fit, ranked by estimated step time.

The candidates are the product of the axis entries' (``planner/axes/``: each proposes its degrees and the
choices decided with them, given those before it), asked of ``layout_rules`` as they are chosen
(``early_refusal``: a placement refused before the layouts under it exist). A placement's model states alone
(micro-batch independent) prune it when they overflow, one minimal-activation layout still priced to say how close
it comes; otherwise each micro-batch split, each entry's variants (sequence parallelism, the pipeline schedule)
and each recomputation is put to the trainer's rules (``runnable``) and priced (``price.py``: what candidates
share computed once; the step time only of the layouts that fit, and of the closest when none does). This
module names no axis: a new one is a new entry.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dist_trainer.config import CHECKPOINTING, ZERO_STAGES, ModelConfig
from dist_trainer.config_load import config_from_dict
from dist_trainer.layout_rules import Bounds, Layout, check_layout, check_layout_for, divisors, early_refusal
from dist_trainer.planner.axes import AXES, SearchSpace
from dist_trainer.planner.emit import TRAIN_PRECISION, run_config_dict
from dist_trainer.planner.hardware import HardwareProfile, get_hardware
from dist_trainer.planner.memory import (
    DEFAULT_OPTIONS,
    DEFAULT_OVERHEADS,
    Overheads,
    TrainingOptions,
    node_host_bytes,
)
from dist_trainer.planner.price import Measured, PlannedLayout, Pricer

__all__ = ["PlanResult", "PlannedLayout", "config_check", "plan_layouts", "runnable"]


@dataclass
class PlanResult:
    layouts: list[PlannedLayout]  # fitting layouts, fastest first
    closest: PlannedLayout | None  # when nothing fits: the layout with the fewest device bytes
    gpu_memory_bytes: int
    n_considered: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    host_memory_bytes: int = 0  # the host-memory budget per node that states held in host memory were held to

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


def _refusal(check: Callable[..., object], *args: object, **kwargs: object) -> str | None:
    """The ValueError message of a rule check, or None when it passes."""
    try:
        check(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


def runnable(model: ModelConfig, layout: Layout, *, seq_len: int,
             options: TrainingOptions = DEFAULT_OPTIONS) -> str | None:
    """None when the trainer runs ``layout``, else the reason it refuses it.

    The question is put to the trainer's own rules, on the Layout itself: ``layout_rules.check_layout_for``, which
    the trainer's pre-launch check asks of the Layout its config resolves to (``tests/test_layout_rules.py`` holds
    the two to agreement).
    """
    def check() -> None:
        options.entry.check_regime(layout)  # Config.validate's optimizer rule
        check_layout_for(model, layout, seq_len=seq_len, freeze=options.freeze,
                         precision=TRAIN_PRECISION[options.precision], device_type=options.device,
                         state_dtype=options.optim_state_dtype)

    return _refusal(check)


def config_check(model: ModelConfig, *, seq_len: int,
                 options: TrainingOptions = DEFAULT_OPTIONS) -> Callable[[Layout], str | None]:
    """The slow way to ask the same question as ``runnable``: build and validate the run config ``plan --out``
    would write for a layout and put it to the trainer's whole check (``layout_rules.check_layout``), as the search
    did before issue 26. ``plan_layouts(check=...)`` takes it to show both rank alike."""
    def check(layout: Layout) -> str | None:
        def whole() -> None:
            cfg = config_from_dict(run_config_dict(model, layout, seq_len=seq_len, options=options)).validate()
            check_layout(cfg, layout.world_size, options.device)
        return _refusal(whole)
    return check


# The largest problem the planner takes: ten times the largest clusters and batches in use, so that the search
# (every divisor of the GPU count and of each replica's batch) ends in seconds for any input.
OFFLOAD_SHARES = (0.5, 1.0)  # parallel.activation_offload the search tries where the activations do not fit
MAX_GPUS = 1 << 20
MAX_GPUS_PER_NODE = 1024
MAX_GLOBAL_BATCH = 1 << 20  # sequences per step


def plan_layouts(model: ModelConfig, *, n_gpus: int, gpus_per_node: int, gpu_memory_bytes: int, seq_len: int,
                 global_batch: int, hardware: str | HardwareProfile = "A100-80GB",
                 options: TrainingOptions = DEFAULT_OPTIONS, overheads: Overheads = DEFAULT_OVERHEADS,
                 zero_stages: tuple[int, ...] = ZERO_STAGES, allow_offload: bool = True,
                 checkpointing: tuple[str, ...] = CHECKPOINTING,
                 pp_schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b"), top_k: int | None = None,
                 tp_size: int | None = None, max_tp_size: int | None = None, pp_size: int | None = None,
                 host_memory_bytes: int | None = None, max_cp_size: int | None = None,
                 check: Callable[[Layout], str | None] | None = None, choose_loss_chunk: bool = False) -> PlanResult:
    """Every layout of ``model`` on ``n_gpus`` that the trainer runs, the fitting ones ranked by estimated step time.

    Enumerated: the product of the axis entries' candidates (``planner/axes/``: each module docstring says which),
    micro-batches dividing each replica's batch, the entries' variants and the recomputation modes; each is put to the
    trainer's own rules (early, as its fields are chosen: ``layout_rules.early_refusal``; whole: ``runnable``) and
    only those it accepts are priced and ranked. What the user's cluster or code allows narrows the entries'
    candidates: ``tp_size`` (exactly) or ``max_tp_size``, ``pp_size`` (1: no pipeline), ``max_cp_size``,
    ``zero_stages``, ``allow_offload``, ``pp_schedules``. Fitting: the worst rank's device bytes within
    ``gpu_memory_bytes``, and a node's host bytes (ranks per node x a rank's offloaded states and activations) within
    ``host_memory_bytes``, by default the hardware's host memory per GPU x gpus_per_node. ``check``: the refusal
    of a candidate (default ``runnable``; ``benchmarks/planner_speed.py`` passes the trainer's whole config check
    to show both rank alike). ``choose_loss_chunk``: where the model leaves ``loss_chunk_tokens`` at 0, each layout
    priced with the chunk the planner chooses for it (``loss_costs.default_loss_chunk``; ``PlannedLayout``
    names it), as ``plan`` does.
    """
    start = time.perf_counter()
    zero_stages, checkpointing = _priced_choices(model, options, zero_stages, checkpointing)
    _check_inputs(model, options, seq_len, n_gpus=n_gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
                  gpu_memory_bytes=gpu_memory_bytes, tp_size=tp_size, max_tp_size=max_tp_size, pp_size=pp_size)
    hw = get_hardware(hardware)
    host_memory = hw.host_memory_per_node(gpus_per_node) if host_memory_bytes is None else host_memory_bytes
    space = SearchSpace(model, n_gpus, gpus_per_node, seq_len, global_batch, options, zero_stages, allow_offload,
                        pp_schedules, tp_size, max_tp_size, pp_size, max_cp_size)
    pl = Pricer(model, seq_len, options, overheads, hw, gpus_per_node, gpu_memory_bytes, host_memory,
                choose_loss_chunk)
    found = _Found(pl, gpu_memory_bytes)
    skipped = _Skipped()
    considered = 0
    refused = _Refused(check or (lambda key: runnable(model, key, seq_len=seq_len, options=options)), skipped)
    for base in _placements(space, skipped):
        per_rank = global_batch // base.global_batch_size  # sequences of one step per rank of a replica
        lightest = base.derive(n_microbatches=per_rank, activation_checkpointing="full",
                           **{k: v for axis in AXES for k, v in axis.lightest(base).items()})
        states, considered = pl.memory_of(lightest), considered + 1  # model states alone: prune on overflow
        if states.device_total > gpu_memory_bytes or node_host_bytes(
                states.host, world_size=n_gpus, gpus_per_node=gpus_per_node) > host_memory:
            found.add(pl.measure(lightest))  # no micro-batch can help (the states' host bytes depend on none)
            continue
        for shape in _shapes(space, base, per_rank):
            if refused(shape) is not None:
                continue  # the trainer refuses it (whatever the recomputation): never ranked
            measure = pl.measurer(shape)
            for ck in checkpointing:
                tried = _recomputed(measure, ck)
                considered += len(tried)
                for measured in tried:
                    found.add(measured)
    fitting, closest = found.fitting, found.closest
    # Equal times (communication hidden behind backward): prefer the simpler layout, then the smaller one.
    fitting.sort(key=lambda x: (round(x.time.total, 9), *x.layout.simplicity, x.memory.device_total))
    fitting = fitting if top_k is None else fitting[:top_k]
    notes = [] if fitting else _nothing_fits_notes(closest, found.host_short, skipped, gpu_memory_bytes, host_memory,
                                                   n_gpus=n_gpus, gpus_per_node=gpus_per_node)
    return PlanResult(fitting, None if fitting or closest is None else pl.price(closest), gpu_memory_bytes, considered,
                      time.perf_counter() - start, notes, host_memory)


def _placements(space: SearchSpace, skipped: _Skipped) -> Iterator[Layout]:
    """The product of the entries' candidates, depth first in their order, each partial choice asked of
    layout_rules' early rules as soon as they can answer (a refused one is never extended)."""
    bounds = Bounds(space.n_gpus, space.gpus_per_node, space.global_batch, space.pp_schedules,
                    space.options.freeze, space.options.optim_state_dtype)

    def grow(chosen: dict[str, Any], depth: int) -> Iterator[Layout]:
        if depth == len(AXES):
            yield Layout(**chosen)
            return
        for fields in AXES[depth].candidates(space, chosen):
            why = early_refusal(space.model, {**chosen, **fields}, bounds, decided=fields.keys())
            if why is not None:
                skipped.add(*why)
            else:
                yield from grow({**chosen, **fields}, depth + 1)

    return grow({}, 0)


def _shapes(space: SearchSpace, base: Layout, per_rank: int) -> Iterator[Layout]:
    """Each micro-batch split of a placement's batch per replica, with each combination of the entries' variants."""
    for mb in divisors(per_rank):
        split = base.derive(micro_batch_size=mb, n_microbatches=per_rank // mb)
        # the last entry's variants outermost (the pipeline schedule around sequence parallelism)
        for variant in itertools.product(*(axis.variants(space, split) for axis in reversed(AXES))):
            yield split.derive(**{k: v for fields in variant for k, v in fields.items()})


class _Found:
    """What the search found: the layouts that fit (priced), those that fit the GPU but whose host bytes (offloaded
    states or activations) overflow the node's host memory, and of the rest the one with the fewest device bytes
    (timed only if nothing fits)."""

    def __init__(self, pl: Pricer, gpu_memory_bytes: int) -> None:
        self.pl, self.memory = pl, gpu_memory_bytes
        self.fitting: list[PlannedLayout] = []
        self.host_short: list[Measured] = []
        self.closest: Measured | None = None

    def add(self, measured: Measured) -> None:
        if measured.fits:
            self.fitting.append(self.pl.price(measured))
        elif measured.device_total <= self.memory:
            self.host_short.append(measured)
        else:
            self.closest = _closer(self.closest, measured)


def _closer(closest: Measured | None, cand: Measured) -> Measured:
    """The one of the two with the fewest device bytes (the first on a tie)."""
    return cand if closest is None or cand.device_total < closest.device_total else closest


class _Refused:
    """``check`` per layout without recomputation (it decides nothing there), each refusal noted once."""

    def __init__(self, check: Callable[[Layout], str | None], skipped: _Skipped) -> None:
        self.check, self.skipped = check, skipped
        self.seen: dict[Layout, str | None] = {}

    def __call__(self, key: Layout) -> str | None:
        if key in self.seen:
            return self.seen[key]
        self.seen[key] = why = self.check(key)
        if why is not None:
            self.skipped.add("refused by the trainer's pre-launch check (layout_rules)", why)
        return why


def _check_inputs(model: ModelConfig, options: TrainingOptions, seq_len: int, *, tp_size: int | None,
                  max_tp_size: int | None, pp_size: int | None, **sizes: int) -> None:
    """ValueError naming the input the search cannot take (and the model or options' own)."""
    model.validate()
    options.validate()
    for name, v in {"seq_len": seq_len, **sizes}.items():
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    for name, v, most in (("n_gpus", sizes["n_gpus"], MAX_GPUS), ("gpus_per_node", sizes["gpus_per_node"],
                                                                   MAX_GPUS_PER_NODE),
                          ("global_batch", sizes["global_batch"], MAX_GLOBAL_BATCH)):
        if v > most:  # the search's work grows with the divisors of these: bounded for any input (issue 28)
            raise ValueError(f"{name}={v:,} is beyond the planner's maximum of {most:,}")
    n_gpus, gpus_per_node = sizes["n_gpus"], sizes["gpus_per_node"]
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


def _nothing_fits_notes(closest: Measured | None, host_short: list[Measured], skipped: _Skipped,
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


def _priced_choices(model: ModelConfig, options: TrainingOptions, zero_stages: tuple[int, ...],
                    checkpointing: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The stages the optimizer's entry runs under (an optimizer of whole matrices: its own), and the recomputation
    modes the planner prices for ``model`` (op-level recomputation runs on an encoder-decoder, unpriced:
    planner/seq2seq.py)."""
    entry_stages = options.entry.zero_stages
    stages = tuple(z for z in zero_stages if entry_stages is None or z in entry_stages)
    return stages, tuple(ck for ck in checkpointing if not (model.encoder_decoder and ck == "op"))


def _recomputed(measure: Callable[[str, int, float], Measured], ck: str) -> list[Measured]:
    """A shape with recomputation ``ck`` measured (``Pricer.measurer``); a layout that keeps its layers'
    activations and does not fit measured again offloading them (half, then all of its layers, model_offload.py)
    until one fits (one that fits only loses time by it). The last measured may fit; the others do not."""
    every = 2 if ck == "every_k" else 1
    tried: list[Measured] = []
    for share in (0.0, *OFFLOAD_SHARES) if ck in ("none", "selective") else (0.0,):
        tried.append(measure(ck, every, share))
        if tried[-1].fits:
            break
    return tried
