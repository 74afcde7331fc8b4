"""The ranks as one named grid, built once: ``grid = arange(world).view(*MESH_AXES sizes)``.

The axes and their order are ``layout_rules.MESH_AXES`` (outermost first, tp innermost so a TP group is
consecutive ranks inside a node); each axis's size is the Layout's ``<axis>_size``. A rank's coordinates are read
off the grid, and its groups are the grid's lines through it, made by ``torch.distributed.device_mesh`` (one
``init_device_mesh`` call, every group with the run's collective timeout). Expert parallelism lives inside dp:
the dp axis unflattened into (edp, ep), ep fastest (``layout_rules.expert_groups``); and the ranks that hold the
same parameters are the ``REPLICA_AXES`` flattened (``replicas``). A new axis is a new name in ``MESH_AXES`` (and
in ``REPLICA_AXES`` when its ranks hold the same parameters) and its rule in ``layout_rules``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dist_trainer.layout_rules import REPLICA_AXES, Layout, expert_groups, mesh_shape


@dataclass
class Mesh:
    """The grid of ranks (``grid[c_0, c_1, ...]`` = global rank), this rank's place in it, and its groups.

    ``groups`` maps each axis (the mesh's, and ep/edp when expert parallelism splits dp) to this rank's process
    group on it; an axis of one rank has none. ``device_mesh`` is torch's (None on one process).
    """

    names: tuple[str, ...]
    grid: torch.Tensor
    rank: int
    device_mesh: DeviceMesh | None = None
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    extra_lines: dict[str, tuple[int, ...]] = field(default_factory=dict)  # ep/edp: this rank's line

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.names, self.grid.shape))

    def coordinates(self, rank: int | None = None) -> dict[str, int]:
        """Axis -> the index of ``rank`` (default: this rank) along it, read off the grid."""
        where = (self.grid == (self.rank if rank is None else rank)).nonzero()[0]
        return {name: int(i) for name, i in zip(self.names, where)}

    def line(self, axis: str, rank: int | None = None) -> tuple[int, ...]:
        """The global ranks of ``rank``'s group on ``axis`` (this rank by default), in axis order."""
        if axis in self.extra_lines and rank is None:
            return self.extra_lines[axis]
        at = self.coordinates(rank)
        index = tuple(slice(None) if name == axis else at[name] for name in self.names)
        return tuple(int(r) for r in self.grid[index].flatten())

    def lines(self, *axes: str) -> list[tuple[int, ...]]:
        """Every group spanning ``axes`` (the others fixed), each in mesh order, the groups in grid order."""
        dims = [self.names.index(a) for a in axes]
        rest = [d for d in range(len(self.names)) if d not in dims]
        size = 1
        for d in dims:
            size *= self.grid.shape[d]
        rows = self.grid.permute(*rest, *sorted(dims)).reshape(-1, size)
        return [tuple(int(r) for r in row) for row in rows]


def build_mesh(layout: Layout, world_size: int, rank: int, timeout_s: float) -> Mesh:
    """The mesh of ``layout`` on ``world_size`` ranks, its groups created (collective: every rank calls it, once)."""
    shape = mesh_shape(layout)
    if math.prod(shape.values()) != world_size:
        raise ValueError(f"the mesh {' x '.join(f'{a}={n}' for a, n in shape.items())} does not hold the world of "
                         f"{world_size} ranks")
    grid = torch.arange(world_size).view(*shape.values())
    mesh = Mesh(tuple(shape), grid, rank)
    if world_size == 1:
        mesh.groups = dict.fromkeys((*shape, "ep", "edp", "replicas"))
        mesh.extra_lines.update(ep=(rank,), edp=(rank,), replicas=(rank,))
        return mesh
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    options = _options(device_type, timedelta(seconds=timeout_s))
    backend = "nccl" if device_type == "cuda" else "gloo"
    device_mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape),
                                   backend_override={a: (backend, options) for a in shape})
    mesh.device_mesh = device_mesh
    mesh.groups = {a: device_mesh.get_group(a) if n > 1 else None for a, n in shape.items()}
    _expert_axes(mesh, layout.ep_size, backend, options)
    _replica_axis(mesh, backend, options)
    return mesh


def _options(device_type: str, timeout: timedelta) -> Backend.Options:
    """The backend options that give every group the run's collective timeout (a dead peer fails the job)."""
    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return opts
    return Backend.Options("gloo", timeout)


def _expert_axes(mesh: Mesh, ep_size: int, backend: str, options: Backend.Options) -> None:
    """ep and edp inside dp: dp unflattened into (edp, ep), ep fastest. At ep 1 there is no ep group and edp is
    dp itself (a dense run makes no extra group)."""
    dp_line = mesh.line("dp")
    if ep_size == 1:
        mesh.groups.update(ep=None, edp=mesh.groups["dp"])
        mesh.extra_lines.update(ep=(mesh.rank,), edp=dp_line)
        return
    assert mesh.device_mesh is not None
    dp_size = len(dp_line)
    # DeviceMesh._unflatten: torch's own split of a mesh axis (torchtitan builds its dp_shard/dp_replicate so)
    sub = mesh.device_mesh["dp"]._unflatten(0, (dp_size // ep_size, ep_size), ("edp", "ep"),
                                            backend_override={"edp": (backend, options), "ep": (backend, options)})
    d = dp_line.index(mesh.rank)
    for axis, lines in zip(("ep", "edp"), expert_groups(dp_size, ep_size)):  # dp indices; the rule's order
        mesh.extra_lines[axis] = tuple(dp_line[i] for i in next(line for line in lines if d in line))
    mesh.groups.update(ep=sub.get_group("ep"), edp=sub.get_group("edp") if dp_size > ep_size else None)


def _replica_axis(mesh: Mesh, backend: str, options: Backend.Options) -> None:
    """replicas: the ranks holding the same parameters (the ``REPLICA_AXES`` flattened), over which gradients are
    averaged and ZeRO partitions; dp's own group when the others have one rank."""
    shape = mesh.shape
    axes = tuple(a for a in REPLICA_AXES if shape.get(a, 1) > 1 or a == "dp")
    if len(axes) == 1:
        mesh.groups["replicas"], mesh.extra_lines["replicas"] = mesh.groups["dp"], mesh.line("dp")
        return
    assert mesh.device_mesh is not None
    at = mesh.coordinates()
    index = tuple(slice(None) if name in axes else at[name] for name in mesh.names)
    mesh.extra_lines["replicas"] = tuple(int(r) for r in mesh.grid[index].flatten())
    flat = mesh.device_mesh[axes]._flatten("replicas", backend_override=(backend, options))  # torchtitan's way
    mesh.groups["replicas"] = flat.get_group()
