"""What every axis entry of the planner declares (``Axis``), what it is handed (``SearchSpace`` to propose
candidates, ``StepContext`` to price one layout) and what it answers (``AxisTime``). Torch-free.

An entry is one module of this folder holding ``AXIS``: its candidate degrees (and the choices that come with
them, e.g. the ZeRO stage) for a search, the per-shape variants it adds (sequence parallelism, the pipeline
schedule), its memory term, its time (seconds on the link, the exposed part, the bytes it sends) and the traffic
a run's plan check compares with what its ``AxisGroup`` counted. ``planner/search.py`` takes the product of
the entries' candidates and ``planner/cost.py`` sums their times; neither names an axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import Layout

if TYPE_CHECKING:
    from dist_trainer.planner.hardware import HardwareProfile
    from dist_trainer.planner.options import Overheads, TrainingOptions
    from dist_trainer.planner.rank_params import RankParams

Fields = dict[str, Any]  # Layout fields an entry sets


@dataclass(frozen=True)
class AxisTime:
    """One axis's traffic in a step: bytes this rank sends, seconds they take, the exposed part, and why."""

    bytes: float
    time: float
    exposed: float
    rule: str


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by component, and what it means for throughput."""

    compute: float
    bubble: float
    axes: dict[str, AxisTime]  # each entry's terms (tp, pp, dp, offload, ...): traffic, time, exposed part, rule
    total: float
    model_flops: float
    mfu: float

    @property
    def tp_comm(self) -> float:
        return self._exposed("tp")

    @property
    def pp_comm(self) -> float:
        return self._exposed("pp")

    @property
    def dp_comm(self) -> float:
        return self._exposed("dp")

    @property
    def offload(self) -> float:
        return self._exposed("offload")

    @property
    def comm_bytes(self) -> dict[str, float]:
        return {k: a.bytes for k, a in self.axes.items()}

    def _exposed(self, axis: str) -> float:
        return self.axes[axis].exposed if axis in self.axes else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "tp_comm": self.tp_comm, "pp_comm": self.pp_comm, "dp_comm": self.dp_comm,
                "offload": self.offload}


def ring_time(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of one ring collective over ``n`` ranks: ``nbytes`` is the full buffer (all-reduce, the gathered
    or scattered whole) or the message (p2p)."""
    if kind == "p2p":
        return nbytes / bandwidth + latency
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency  # all_gather, reduce_scatter


def placed_ranks(chosen: Mapping[str, Any]) -> int:
    """The ranks one cell of the axes chosen so far spans: the product of their degrees."""
    return math.prod(v for k, v in chosen.items() if k.endswith("_size"))


@dataclass(frozen=True)
class SearchSpace:
    """What a search is held to: the model, the world, the batch, and the user's narrowing of each axis."""

    model: ModelConfig
    n_gpus: int
    gpus_per_node: int
    seq_len: int
    global_batch: int
    options: TrainingOptions
    zero_stages: tuple[int, ...]
    allow_offload: bool
    pp_schedules: tuple[str, ...]
    tp_size: int | None = None
    max_tp_size: int | None = None
    pp_size: int | None = None
    max_cp_size: int | None = None

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.n_gpus)


@dataclass  # not frozen: built per priced layout, and a frozen dataclass's __init__ costs several times more
class StepContext:
    """What ``estimate_step_time`` hands each entry to price one layout: the shape, the rank's work and holdings,
    and the two links. ``layers``: the global layers of every pipeline rank; ``compute``: the slowest stage's
    seconds; ``backward_one``: one micro-batch's backward; ``n_rank`` parameters on this rank, ``trainable`` of
    them train, ``expert`` (``expert_trainable``) of them are its experts under expert parallelism."""

    cfg: ModelConfig
    layout: Layout
    options: TrainingOptions
    hardware: HardwareProfile
    seq_len: int
    gpus_per_node: int
    tokens: int  # a micro-batch's tokens on this rank
    layers: list[list[int]]
    most_layers: int
    compute: float
    backward_one: float
    n_rank: int
    trainable: int
    expert: int
    expert_trainable: int

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element in the compute dtype."""
        return 4 if self.options.precision == "fp32" else 2

    @property
    def intra(self) -> tuple[float, float]:
        return self.hardware.intra_node_bw, self.hardware.intra_node_latency

    @property
    def inter(self) -> tuple[float, float]:
        return self.hardware.inter_node_bw, self.hardware.inter_node_latency

    def link(self, consecutive_ranks: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group spanning ``consecutive_ranks`` global ranks: the node's link when they
        fit one node, else the network."""
        return self.intra if consecutive_ranks <= self.gpus_per_node else self.inter


class Axis(Protocol):
    """One axis of the planner (module docstring)."""

    name: str

    def candidates(self, space: SearchSpace, chosen: Mapping[str, Any]) -> list[Fields]:
        """The Layout fields this axis may take given the fields the entries before it chose (its degree, and
        the choices decided with it); the search asks ``layout_rules`` of each."""
        ...

    def variants(self, space: SearchSpace, layout: Layout) -> list[Fields]:
        """Per-shape choices this axis adds to a placed layout (each tried; ``[{}]`` for none)."""
        ...

    def lightest(self, layout: Layout) -> Fields:
        """The variant with the least activation memory (the search prunes on model states with it)."""
        ...

    def memory(self, cfg: ModelConfig, layout: Layout, rp: RankParams, *, seq_len: int, options: TrainingOptions,
               overheads: Overheads, trainable: int, expert: int) -> dict[str, int]:
        """This axis's device bytes beyond the model states and activations (buffers), by name."""
        ...

    def time(self, ctx: StepContext) -> dict[str, AxisTime]:
        """This axis's terms of one step (none when its degree is 1)."""
        ...

    def counted(self, cfg: ModelConfig, layout: Layout, options: TrainingOptions, *, seq_len: int,
                pp_rank: int, layer_ids: list[int]) -> dict[str, tuple[str, str | None, int]]:
        """The traffic this axis prices exactly, as a run's plan check reads it: figure -> (axis, op or None,
        bytes that pipeline rank hands to its ``AxisGroup`` in one step)."""
        ...


class AxisEntry:
    """Defaults for an entry: no variants, no memory term, no counted traffic."""

    name = ""

    def variants(self, space: SearchSpace, layout: Layout) -> list[Fields]:
        return [{}]

    def lightest(self, layout: Layout) -> Fields:
        return {}

    def memory(self, cfg: ModelConfig, layout: Layout, rp: RankParams, *, seq_len: int, options: TrainingOptions,
               overheads: Overheads, trainable: int, expert: int) -> dict[str, int]:
        return {}

    def counted(self, cfg: ModelConfig, layout: Layout, options: TrainingOptions, *, seq_len: int,
                pp_rank: int, layer_ids: list[int]) -> dict[str, tuple[str, str | None, int]]:
        return {}
