"""The one ``Layout``: the degrees and choices of a parallel layout on a world, its own fields' rules, the one
conversion from a run config (``layout_of``), the mesh's axes and the regime a layout runs under. Torch-free."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dist_trainer.config import (
    CHECKPOINTING,
    CP_MODES,
    PP_BALANCES,
    PP_SCHEDULES,
    ZERO_STAGES,
    ModelConfig,
    ParallelConfig,
    check_fields,
)
from dist_trainer.layout_rules.pipeline import check_schedule, layers_per_stage, rank_layer_ids

REGIMES = ("ddp", "pipeline", "zero")  # engines/__init__.py holds one engine per name

# The rank grid's axes, outermost first (parallel/mesh.py builds ``arange(world).view(*sizes)``): tp innermost, so
# a TP group is consecutive ranks and stays inside a node; then cp (its ring next), pp, dp (Megatron's order).
MESH_AXES: tuple[str, ...] = ("dp", "pp", "cp", "tp")
# The axes whose ranks hold the same parameters, dp first: the mesh flattens them into one ``replicas`` group, over
# which gradients are averaged and ZeRO partitions (cp ranks see other tokens of the same samples).
REPLICA_AXES: tuple[str, ...] = ("dp", "cp")


def _degrees_of(axes: tuple[str, ...]) -> Callable[[Any], tuple[int, ...]]:
    """A Layout's degrees of ``axes``, read at C speed (the planner's search asks for them per candidate)."""
    get: Callable[[Any], Any] = operator.attrgetter(*(f"{a}_size" for a in axes))
    return (lambda layout: (get(layout),)) if len(axes) == 1 else get


_MESH_DEGREES = _degrees_of(MESH_AXES)
_REPLICA_DEGREES = _degrees_of(REPLICA_AXES)


@dataclass(frozen=True)
class Layout:
    """One parallel layout on a world of known size: the degrees, whose product is the world, and every choice that
    shapes a rank's work. The trainer builds it from its config (``layout_of``), the planner's search one per
    candidate; the pre-launch check, the engines, the mesh and the planner's memory, cost and search all read this
    object. Frozen, and its fields are checked as it is built (``config.check_fields``, the rules a run config's
    parallel section is validated by); what depends on the model is ``check_layout_for``.

    ``micro_batch_size`` x ``n_microbatches`` x ``dp_size`` is the global batch: ``n_microbatches`` is each data-
    parallel rank's micro-batches per step (the pipeline's micro-batches, or gradient accumulation elsewhere).
    """

    tp_size: int = 1  # tensor-parallel degree (Megatron column/row split); innermost, so a TP group stays in a node
    pp_size: int = 1  # pipeline stages (x pp_virtual_stages model chunks)
    dp_size: int = 1  # data-parallel replicas
    cp_size: int = 1  # context parallelism: each sequence split over cp ranks (parallel/cp/)
    cp_mode: str = "ring"  # ring | all_to_all (layout_rules.cp.CP_MODES)
    ep_size: int = 1  # expert parallelism: each MoE layer's experts split over ep of the dp ranks (ep divides dp)
    zero_stage: int = 0  # 0 = no ZeRO; 1/2/3 = DeepSpeed ZeRO over the dp ranks
    zero_offload: bool = False  # ZeRO-Offload: optimizer states (stage 3: and parameters) in host memory
    micro_batch_size: int = 1  # sequences per forward/backward on one rank
    n_microbatches: int = 1  # micro-batches per dp rank per step
    activation_checkpointing: str = "none"  # none | selective | every_k | full | op (config.CHECKPOINTING)
    checkpoint_every: int = 1  # every_k: layers whose index % k == 0
    activation_offload: float = 0.0  # share of each rank's layers whose saved activations go to host memory
    sequence_parallel: bool = False  # norms and dropout on sequence shards (needs tp > 1)
    pp_schedule: str = "1f1b"  # config.PP_SCHEDULES
    pp_virtual_stages: int = 1  # model chunks per pipeline rank (the interleaved schedules)
    pp_balance: str = "layers"  # how layers_per_stage splits the layers (by count or by parameters)
    pp_stage_layers: tuple[int, ...] | None = None  # explicit (uneven) layers per stage

    def __post_init__(self) -> None:
        if isinstance(self.pp_stage_layers, list):  # YAML and configs hold a list
            object.__setattr__(self, "pp_stage_layers", tuple(self.pp_stage_layers))
        check_fields(self)

    def derive(self, **changes: Any) -> Layout:
        """``dataclasses.replace``, checked the same (``check_fields``) without its per-call introspection of the
        fields: the planner's search derives tens of thousands of candidates. This layout passed the check when it
        was built, so only the changed fields and the rules across fields are asked again; any doubt runs the
        whole check, which names the culprit."""
        if not changes.keys() <= _FIELD_NAMES:
            raise TypeError(f"Layout has no field {', '.join(sorted(changes.keys() - _FIELD_NAMES))}")
        new = object.__new__(Layout)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        if not _changes_pass(new, changes):
            new.__post_init__()
        return new

    def size(self, axis: str) -> int:
        """The degree of a mesh axis (``MESH_AXES``) or of ep."""
        return int(getattr(self, f"{axis}_size"))

    @property
    def world_size(self) -> int:
        return math.prod(_MESH_DEGREES(self))

    @property
    def replicas(self) -> int:
        """The ranks holding the same parameters (``REPLICA_AXES``): gradients are averaged and ZeRO partitions over
        them."""
        return math.prod(_REPLICA_DEGREES(self))

    @property
    def sample_split(self) -> int:
        """Over how many of the replicas each sample is split (the replica axes after dp cut a sequence's tokens):
        DeepSpeed counts each share as one of its samples."""
        return self.replicas // self.dp_size

    def rank_tokens(self, seq_len: int) -> int:
        """Tokens of one micro-batch on one rank: its sequences, or its share of each when they are split."""
        return self.micro_batch_size * seq_len // self.sample_split

    def degrees(self) -> str:
        """The degrees and the ZeRO stage, e.g. ``tp=2 pp=1 dp=4 zero=1`` (ep and cp where > 1)."""
        s = f"tp={self.tp_size} pp={self.pp_size} dp={self.dp_size}"
        if self.ep_size > 1:
            s += f" ep={self.ep_size}"
        if self.cp_size > 1:
            s += f" cp={self.cp_size}({self.cp_mode})"
        return s + f" zero={self.zero_stage}{'+offload' if self.zero_offload else ''}"

    def describe(self) -> str:
        """One line: the degrees and every choice (the planner's tables, ``launch.sh``)."""
        ck = self.activation_checkpointing + (f"/{self.checkpoint_every}" if self.activation_checkpointing ==
                                              "every_k" else "")
        s = f"{self.degrees()} mb={self.micro_batch_size} m={self.n_microbatches} ckpt={ck}"
        s += f" act_offload={self.activation_offload:g}" if self.activation_offload else ""
        s += " sp" if self.sequence_parallel else ""
        if self.pp_size > 1:
            s += f" {self.pp_schedule}" + (f"(v={self.pp_virtual_stages})" if self.pp_virtual_stages > 1 else "")
        return s

    @property
    def simplicity(self) -> tuple[int, bool, int]:
        """What makes a layout simpler to run, least first: the ZeRO stage, offload, the ranks one model replica
        spans (tp x pp): the planner's order among layouts of equal step time."""
        return self.zero_stage, self.zero_offload, self.world_size // self.replicas

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.n_microbatches * self.dp_size

    @property
    def regime(self) -> str:
        return regime_of(self)

    def stage_counts(self, model: ModelConfig) -> list[int]:
        """Layers per stage (pp_size x pp_virtual_stages stages), as the trainer splits them."""
        return layers_per_stage(model, self.pp_size * self.pp_virtual_stages, self.pp_balance,
                                None if self.pp_stage_layers is None else list(self.pp_stage_layers))

    def rank_layer_ids(self, model: ModelConfig, pp_rank: int) -> list[int]:
        """Global indices of the layers pipeline rank ``pp_rank`` holds (its stages r, r + pp, ...: the loop
        placement of the interleaved schedule)."""
        return rank_layer_ids(self.stage_counts(model), pp_rank, self.pp_size)

    def layers_by_rank(self, model: ModelConfig) -> list[list[int]]:
        """``rank_layer_ids`` of every pipeline rank, the split computed once."""
        counts = self.stage_counts(model)
        return [rank_layer_ids(counts, r, self.pp_size) for r in range(self.pp_size)]


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Layout))


def _changes_pass(new: Layout, changes: dict[str, Any]) -> bool:
    """Whether the ``changes`` that made ``new`` out of a checked Layout pass ``check_fields`` (False: run it)."""
    for name, value in changes.items():
        if name in _COUNT_NAMES:
            if type(value) is not int or value < 1:
                return False
        elif name in _CHOICES:
            if value not in _CHOICES[name]:
                return False
        elif name == "zero_stage":
            if value not in ZERO_STAGES or isinstance(value, bool):
                return False
        elif name == "activation_offload":  # check_fields' rule: a share of the layers
            if type(value) not in (int, float) or not 0 <= value <= 1:
                return False
        elif name == "pp_stage_layers":
            return False
    return new.pp_stage_layers is None and not (new.sequence_parallel and new.tp_size == 1)


_COUNTS = ("tp_size", "pp_size", "cp_size", "ep_size", "micro_batch_size", "checkpoint_every", "pp_virtual_stages")
_COUNT_NAMES = frozenset((*_COUNTS, "dp_size", "n_microbatches"))
_CHOICES = {"activation_checkpointing": CHECKPOINTING, "pp_schedule": PP_SCHEDULES, "pp_balance": PP_BALANCES,
            "cp_mode": CP_MODES}


def layout_of(parallel: ParallelConfig, world_size: int) -> Layout:
    """The Layout a validated run config's parallel section takes on ``world_size`` ranks (ValueError naming the
    values when the degrees or the batch do not fit the world). Each dp rank runs ``global / dp`` sequences per
    step: in micro-batches of ``micro_batch_size`` (gradient accumulation), or, for a pipeline given
    ``n_microbatches``, cut into that many.

    The section's fields passed ``check_fields`` when it was validated (``ParallelConfig.validate``, once per
    launch), and dp and the micro-batches derived here are positive by construction, so the Layout is built without
    asking the same rules again."""
    dp = parallel.resolve(world_size)
    per_rank = parallel.global_batch_size // dp
    micro = parallel.micro_batch_size
    n_micro = per_rank // micro
    if parallel.pp_size > 1 and parallel.n_microbatches:  # the schedule cuts each dp rank's batch its own way
        n_micro = parallel.n_microbatches
        check_schedule(parallel.pp_size, parallel.pp_schedule, n_micro, per_rank, parallel.pp_virtual_stages)
        micro = per_rank // n_micro
    layers = parallel.pp_stage_layers
    layout = object.__new__(Layout)
    layout.__dict__.update({n: getattr(parallel, n) for n in _FIELD_NAMES}, dp_size=dp, n_microbatches=n_micro,
                           micro_batch_size=micro, pp_stage_layers=None if layers is None else tuple(layers))
    return layout


def regime_of(parallel: Layout | ParallelConfig) -> str:
    """The regime that runs this layout: pipeline stages (with ZeRO-1 over their dp replicas when zero_stage is 1),
    DeepSpeed ZeRO, or DDP (each with TP inside)."""
    if parallel.pp_size > 1:
        return "pipeline"
    if parallel.zero_stage > 0:
        return "zero"
    return "ddp"


def needs_process_group(parallel: Layout | ParallelConfig) -> bool:
    """Whether the layout needs torch.distributed even on one process (DeepSpeed's engine does)."""
    return parallel.zero_stage > 0


def mesh_shape(layout: Layout) -> dict[str, int]:
    """Axis -> size, in ``MESH_AXES`` order: the layout's ``<axis>_size`` for each."""
    return {axis: layout.size(axis) for axis in MESH_AXES}


def saved_layout(layout: Layout) -> dict[str, int]:
    """What a checkpoint records of its layout (``meta.json``'s "layout"): every mesh axis's degree, ep, the world."""
    return {**mesh_shape(layout), "ep": layout.ep_size, "world": layout.world_size}


def saved_replicas(saved: dict[str, int]) -> int:
    """The replicas of a checkpoint's layout (``saved_layout``; an axis it does not name had one rank)."""
    return math.prod(saved.get(a, 1) for a in REPLICA_AXES)
