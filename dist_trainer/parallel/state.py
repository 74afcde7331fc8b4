"""ParallelState: this rank's place in the mesh (``parallel/mesh.py``) and one counted ``AxisGroup`` per axis.

Built once per run from the Layout and passed explicitly to whatever needs a group: there are no module globals.
The axes are the mesh's (``layout_rules.MESH_AXES``) plus ep and edp inside dp for expert parallelism (one-rank
axes, edp being dp itself, when ep_size is 1) and ``replicas``, the ranks holding the same parameters (the
``REPLICA_AXES`` flattened; dp itself when the others have one rank); every axis is made in the same loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from dist_trainer.config import ParallelConfig
from dist_trainer.layout_rules import MESH_AXES, REPLICA_AXES, Layout, layout_of
from dist_trainer.parallel.comm import AxisGroup, CommCounter
from dist_trainer.parallel.mesh import Mesh, build_mesh

EXPERT_AXES = ("ep", "edp")  # inside dp (layout_rules.expert_groups)
AXES = (*MESH_AXES, *EXPERT_AXES, "replicas")


class _Axis:
    """``state.<axis>``: that axis's AxisGroup in ``state.axes``, for the axes the whole package uses; an axis only
    its own mechanism uses is ``state.axes[name]`` (a new axis needs no line here)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: ParallelState, owner: type | None = None) -> AxisGroup:
        return state.axes[self.name]

    def __set__(self, state: ParallelState, group: AxisGroup) -> None:
        state.axes[self.name] = group


@dataclass
class ParallelState:
    """This rank's axes, each an ``AxisGroup`` (process group, size, rank) sharing one ``CommCounter``, and the mesh
    they were read off. An axis of one rank holds no group and its collectives return at once (Megatron keeps its
    groups in module globals; here the state is an object passed in)."""

    layout: Layout
    mesh: Mesh
    axes: dict[str, AxisGroup]
    rank: int
    world_size: int
    counter: CommCounter = field(default_factory=CommCounter)

    dp = _Axis()
    pp = _Axis()
    tp = _Axis()
    replicas = _Axis()
    ep = _Axis()
    edp = _Axis()

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def pp_size(self) -> int:
        return self.pp.size

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def ep_size(self) -> int:
        return self.ep.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def expert_replicas(self) -> list[AxisGroup]:
        """The axes whose ranks hold the same experts: edp, then the replica axes after dp (an expert's gradient is
        averaged over each in turn)."""
        return [self.edp, *(self.axes[a] for a in REPLICA_AXES[1:])]

    def replica_coordinate(self, expert: bool = False) -> tuple[int, int]:
        """(index, count) of this rank among the replicas of a dense parameter, or of an expert's (``expert``):
        the mixed-radix index over ``expert_replicas``, outermost first, for experts."""
        if not expert:
            return self.replicas.rank, self.replicas.size
        index, count = 0, 1
        for axis in self.expert_replicas:
            index, count = index * axis.size + axis.rank, count * axis.size
        return index, count

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size}: {self.describe_rank(self.rank)}"

    def describe_rank(self, rank: int) -> str:
        """A rank's coordinates, read off the mesh (ep, when there is one: its dp index modulo ep)."""
        at = self.mesh.coordinates(rank)
        where = ", ".join(f"{a} {at[a]}/{n}" for a, n in self.mesh.shape.items() if n > 1 or a in ("dp", "pp", "tp"))
        ep = self.ep.size
        return where + (f", ep {at['dp'] % ep}/{ep}" if ep > 1 else "")

    def grid_axes(self) -> list[AxisGroup]:
        """The mesh's axes, innermost (tp) first: reducing or gathering over each in turn covers the world once,
        and gathers come out in rank order."""
        return [self.axes[a] for a in reversed(MESH_AXES)]

    def group_ranks(self) -> dict[str, tuple[int, ...]]:
        """Axis -> the global ranks of this rank's group on that axis (the expert-parallel ep and edp too)."""
        return {name: a.ranks for name, a in self.axes.items()}

    @classmethod
    def single(cls) -> ParallelState:
        """One process, no process groups: every collective is a no-op."""
        return cls.build(Layout(), 1, 0)

    @classmethod
    def build(cls, layout: Layout | ParallelConfig, world_size: int | None = None, rank: int | None = None,
              timeout_s: float | None = None) -> ParallelState:
        """The mesh of ``layout`` (a run config's parallel section is first validated and resolved on the world,
        raising ValueError before any group exists) and an ``AxisGroup`` per axis. Collective: every rank calls it."""
        initialized = dist.is_available() and dist.is_initialized()
        world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if isinstance(layout, ParallelConfig):
            timeout_s = layout.timeout_s if timeout_s is None else timeout_s
            layout.validate()  # layout_of takes a validated section
            layout = layout_of(layout, world_size)
        if world_size > 1 and not initialized:
            raise RuntimeError("ParallelState.build needs an initialised default process group for world_size > 1")
        mesh = build_mesh(layout, world_size, rank, ParallelConfig.timeout_s if timeout_s is None else timeout_s)
        counter = CommCounter()
        axes: dict[str, AxisGroup] = {}
        for axis in AXES:
            if axis == "replicas" and layout.replicas == layout.dp_size:  # dp's ranks: one axis, counted as dp
                axes[axis] = axes["dp"]
                continue
            ranks = mesh.line(axis)
            axes[axis] = AxisGroup(axis, len(ranks), ranks.index(rank), mesh.groups[axis] if len(ranks) > 1 else None,
                                   ranks, counter)
        return cls(layout, mesh, axes, rank, world_size, counter)
