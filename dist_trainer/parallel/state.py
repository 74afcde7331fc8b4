"""ParallelState: the (dp, pp, tp) grid of ranks, its process groups, this rank's coordinates.

The whole topology is ``grid = arange(world).view(dp, pp, tp)`` (``layout_rules.rank_grid``): tp varies fastest,
so the ranks of a TP group are consecutive and, with tp_size <= GPUs per node, stay
inside one node (TP all-reduces are the most frequent and want NVLink). The state is
an object passed explicitly to whatever needs a group: there are no module globals.

Expert parallelism (``parallel.ep_size``) adds two axes inside dp (``layout_rules.expert_groups``): ``ep``, the
ep consecutive dp ranks that hold different experts and exchange tokens, and ``edp``, the dp ranks holding the
same experts, over which those experts' gradients are reduced. Both are one-rank axes when ep_size is 1 (edp is
then dp itself for the experts, which are ordinary parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_trainer.config import ParallelConfig
from dist_trainer.layout_rules import expert_groups, rank_grid
from dist_trainer.parallel.comm import AxisGroup, CommCounter

AXES = ("dp", "pp", "tp", "ep", "edp")


@dataclass
class ParallelState:
    """This rank's place in the grid: one counted ``AxisGroup`` per axis (its process group, size and rank) and the
    ``CommCounter`` they share.

    Built once per run by ``build`` from the layout and passed explicitly to every mechanism that communicates, so
    no module holds a global group (Megatron's ``parallel_state`` keeps them in globals); an axis of one rank
    holds no group and its collectives return at once.
    """

    dp: AxisGroup
    pp: AxisGroup
    tp: AxisGroup
    ep: AxisGroup
    edp: AxisGroup
    rank: int
    world_size: int
    counter: CommCounter = field(default_factory=CommCounter)

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

    def describe(self) -> str:
        ep = f", ep {self.ep.rank}/{self.ep.size}" if self.ep.size > 1 else ""
        return (f"rank {self.rank}/{self.world_size}: dp {self.dp.rank}/{self.dp.size}, "
                f"pp {self.pp.rank}/{self.pp.size}, tp {self.tp.rank}/{self.tp.size}{ep}")

    def describe_rank(self, rank: int) -> str:
        """Another rank's coordinates, read off the grid (tp fastest, then pp, then dp)."""
        tp, pp, ep = self.tp.size, self.pp.size, self.ep.size
        dp = rank // (tp * pp)
        where = f"dp {dp}/{self.dp.size}, pp {rank // tp % pp}/{pp}, tp {rank % tp}/{tp}"
        return where + (f", ep {dp % ep}/{ep}" if ep > 1 else "")  # ep varies fastest inside dp (expert_groups)

    def group_ranks(self) -> dict[str, tuple[int, ...]]:
        """Axis -> the global ranks of this rank's group on that axis (the expert-parallel ep and edp too)."""
        return {a.axis: a.ranks for a in (self.dp, self.pp, self.tp, self.ep, self.edp)}

    @classmethod
    def single(cls) -> ParallelState:
        """One process, no process groups: every collective is a no-op."""
        counter = CommCounter()
        axes = {a: AxisGroup(a, 1, 0, None, (0,), counter) for a in AXES}  # ep, edp: one rank too
        return cls(**axes, rank=0, world_size=1, counter=counter)

    @classmethod
    def build(cls, parallel: ParallelConfig, world_size: int | None = None, rank: int | None = None) -> ParallelState:
        """Validate the degrees against the world size, then create one group per grid line.

        ``dist.new_group`` is collective: every rank creates every group, in the same order.
        """
        initialized = dist.is_available() and dist.is_initialized()
        world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        dp_size = parallel.resolve(world_size)  # raises ValueError before any group is made
        if world_size == 1:
            return cls.single()
        if not initialized:
            raise RuntimeError("ParallelState.build needs an initialised default process group for world_size > 1")
        grid = torch.tensor(rank_grid(world_size, dp_size, parallel.pp_size, parallel.tp_size))  # (dp, pp, tp)
        d, p, t = (int(c) for c in (grid == rank).nonzero()[0])
        counter = CommCounter()
        timeout = timedelta(seconds=parallel.timeout_s)
        lines = {
            "tp": [grid[i, j, :] for i in range(dp_size) for j in range(parallel.pp_size)],
            "pp": [grid[i, :, k] for i in range(dp_size) for k in range(parallel.tp_size)],
            "dp": [grid[:, j, k] for j in range(parallel.pp_size) for k in range(parallel.tp_size)],
        }
        mine = {"tp": grid[d, p, :], "pp": grid[d, :, t], "dp": grid[:, p, t]}
        coord = {"dp": d, "pp": p, "tp": t}
        axes = {}
        for axis in ("tp", "pp", "dp"):
            my_ranks = tuple(int(r) for r in mine[axis])
            group = None
            for line in lines[axis]:
                ranks = [int(r) for r in line]
                if len(ranks) == 1:
                    continue
                # every group inherits the configured timeout: a dead peer fails the job, not hangs it
                g = dist.new_group(ranks, timeout=timeout)
                if tuple(ranks) == my_ranks:
                    group = g
            axes[axis] = AxisGroup(axis, len(my_ranks), coord[axis], group, my_ranks, counter)
        axes.update(_expert_axes(grid, d, p, t, parallel.ep_size, timeout, axes["dp"]))
        return cls(**axes, rank=rank, world_size=world_size, counter=counter)


def _expert_axes(grid: torch.Tensor, d: int, p: int, t: int, ep_size: int, timeout: timedelta,
                 dp: AxisGroup) -> dict[str, AxisGroup]:
    """The ep and edp axes of the rank at (d, p, t): ``layout_rules.expert_groups`` inside each dp line
    (ep_size 1: no ep group, and edp shares the dp group, so a dense run creates no extra group)."""
    counter = dp.counter
    if ep_size == 1:
        return {"ep": AxisGroup("ep", 1, 0, None, (dp.ranks[dp.rank],), counter),
                "edp": AxisGroup("edp", dp.size, dp.rank, dp.group, dp.ranks, counter)}
    dp_size, pp_size, tp_size = grid.shape
    ep_lines, edp_lines = expert_groups(dp_size, ep_size)
    axes = {}
    for axis, lines in (("ep", ep_lines), ("edp", edp_lines)):
        mine = next(line for line in lines if d in line)
        ranks = tuple(int(grid[i, p, t]) for i in mine)
        group = None
        if len(mine) > 1:
            for j in range(pp_size):
                for k in range(tp_size):
                    for line in lines:  # every rank creates every group, in the same order
                        g = dist.new_group([int(grid[i, j, k]) for i in line], timeout=timeout)
                        if (j, k) == (p, t) and line == mine:
                            group = g
        axes[axis] = AxisGroup(axis, len(mine), mine.index(d), group, ranks, counter)
    return axes
