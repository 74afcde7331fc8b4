"""Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks") with AdamW for the rest,
and momentum SGD: the builders of the ``muon`` and ``sgd`` entries of ``optim_entries.py``.

Muon's update of a 2-D hidden matrix W with gradient G (Moonshot's "Muon is scalable for LLM training", 2025,
Algorithm 1, whose scaling gives the update AdamW's RMS so AdamW's learning rate and weight decay carry over)::

    M = mu * M + G                         momentum (``momentum_buffer``, fp32, sharded like W)
    U = G + mu * M                         Nesterov
    O = NS5(U)                             the quintic Newton-Schulz iteration, 5 steps, (a, b, c) below
    W = W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

NS5 needs the whole matrix. Where a matrix is cut over an axis (a TP shard: ``MatrixShard``), each rank computes its
own part of U (the momentum is elementwise), the parts are gathered to one owner rank, orthogonalised there and the
update scattered back: the DistMuon scheme of torchtitan and DeepSpeed's ZeRO Muon, the owners taken round robin
over the axis so the Newton-Schulz work is spread. Data-parallel replicas hold the same averaged gradient and
compute the same update (no traffic); pipeline stages and expert-parallel ranks hold their matrices whole, each
expert its own, and orthogonalise them where they are. Under DeepSpeed's ZeRO-1/2/3 this is DeepSpeed's client
optimizer over flat fp32 partitions: each matrix is rebuilt on an owner dp rank from the ranks' fragments
(``Muon._zero_step``); only where a matrix's fragment lies in the partition differs between the stages
(``Muon.fragments``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.optim.adamw import adamw

from dist_trainer.config import OptimConfig
from dist_trainer.optim_lowbit import closure_loss, params_with_grads
from dist_trainer.parallel.comm import AxisGroup

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024: the quintic maximising the slope at zero
NS_STEPS = 5


def orthogonalize(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """NS5(G): approximately U V^T of G = U S V^T, in fp32 (the published iteration, on the wide orientation so each
    step's Gram matrix is the smaller one)."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def update_scale(shape: tuple[int, ...]) -> float:
    """Moonshot's 0.2 * sqrt(max(A, B)): the orthogonalised update's RMS matched to AdamW's (about 0.2-0.4)."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class Fragment(NamedTuple):
    """This rank's contiguous piece of a matrix in a ZeRO flat partition: where it starts in the flattened matrix
    and in the partition, and its length."""

    matrix: int
    flat: int
    numel: int


@dataclass(frozen=True)
class MatrixShard:
    """A matrix cut into equal contiguous slices along ``dim`` over ``axis``; ``owner`` orthogonalises it."""

    axis: AxisGroup
    dim: int
    owner: int


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked ``use_muon``, torch AdamW's arithmetic (fp32 moments) on the others.

    ``shards``: {id(parameter): MatrixShard} for the matrices this rank holds a slice of (module docstring).
    ``zero``: DeepSpeed's ZeRO data-parallel axis when DeepSpeed wraps this optimizer: it then steps flat fp32
    partitions (one per group at ZeRO-1/2, one per sub group at ZeRO-3: ``follow_zero3``), and each Muon matrix is
    rebuilt from the ranks' fragments on its owner (``_zero_step``).
    """

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, shards: dict[int, MatrixShard] | None = None,
                 zero: AxisGroup | None = None) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "use_muon": False})
        self.shards, self.zero = shards or {}, zero
        # the module's matrices per group, before DeepSpeed puts its flat partitions in their place
        self.matrices = [list(g["params"]) for g in self.param_groups]
        # ZeRO-3: (DeepSpeed's flat fp32 partitions, the parameters of each, with their ds_* attributes),
        # set by follow_zero3
        self.zero3: tuple[list[torch.Tensor], list[list[Any]]] | None = None
        # under ZeRO the k-th matrix orthogonalised since the start is owned by dp rank k mod dp: one count
        # over the steps, so ZeRO-3's sub groups (each stepped in its own call) share the owners out too
        self.owners = itertools.count()

    def follow_zero3(self, ds_optimizer: Any) -> None:
        """Under DeepSpeed's ZeRO-3 (``ds_optimizer``: its stage-3 optimizer wrapping this one): the flat it hands
        ``step`` is ``fp32_partitioned_groups_flat[i]``, the partitions (``ds_tensor``) of the parameters
        ``fp16_groups[i]`` end to end (stage3.py ``_optimizer_step``,
        ``_create_fp16_partitions_with_defragmentation``)."""
        self.zero3 = (ds_optimizer.fp32_partitioned_groups_flat, ds_optimizer.fp16_groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group, p, grad in params_with_grads(self):
            if group["use_muon"] and self.zero is not None:
                self._zero_step(p, grad, group)
            else:
                (self._muon_step if group["use_muon"] else self._adamw_step)(p, grad, group)
        return loss

    def _adamw_step(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """torch's AdamW on one parameter (its functional form, foreach=False: the adamw entry's arithmetic)."""
        state = self.state[p]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group["betas"]
        adamw([p], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]], foreach=False,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)

    def _muon_step(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        u = _momentum_input(self.state[p], grad, group["momentum"])
        shard = self.shards.get(id(p))
        if shard is None:
            update = orthogonalize(u).mul_(update_scale(tuple(u.shape)))
        else:
            update = _orthogonalize_sharded(u, shard)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"])

    def fragments(self, flat: torch.Tensor,
                  group: dict[str, Any]) -> list[tuple[tuple[int, ...], Fragment | None]]:
        """(shape, this rank's fragment) of every matrix of the flat partition ``flat`` of ``group``, in DeepSpeed's
        order; None when this rank holds none of it (it still takes part in each matrix's reduce).

        ZeRO-1/2: DeepSpeed's record on the parameter (``_hp_mapping``: where the fragment lies in the matrix and in
        the partition). ZeRO-3: each parameter is cut on its own into dp equal slices of ``partition_numel()`` =
        ceil(numel / dp) elements (the last zero-padded; partition_parameters.py ``_partition_param``), dp rank r
        holding matrix elements [r s, min((r + 1) s, numel)), and the flat is the slices end to end.
        """
        if self.zero3 is None:
            out = []
            for p in self.matrices[next(i for i, g in enumerate(self.param_groups) if g is group)]:
                mapping = getattr(p, "_hp_mapping", None)
                out.append((tuple(p.shape), None if mapping is None else
                            Fragment(mapping.lp_fragment_address.start, mapping.hp_fragment_address.start,
                                     mapping.hp_fragment_address.numel)))
            return out
        assert self.zero is not None
        flats, params = self.zero3
        sub_group = next(i for i, f in enumerate(flats) if f is flat)
        out, offset = [], 0
        for p in params[sub_group]:
            size = p.partition_numel()
            start = self.zero.rank * size
            numel = min(size, p.ds_numel - start)
            out.append((tuple(p.ds_shape), Fragment(start, offset, numel) if numel > 0 else None))
            offset += size
        assert offset == flat.numel(), f"ZeRO-3 sub group of {offset} partition elements, flat {flat.numel()}"
        return out

    def _zero_step(self, flat: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """One ZeRO partition of a Muon group: the momentum on the partition (elementwise), then per matrix the
        ranks' fragments of U summed into its owner (a reduce of the zero-padded matrix over dp), orthogonalised and
        scaled there, broadcast, and this rank's fragment applied to its fp32 master partition (``fragments``).
        U and the update are formed fragment by fragment (the same elementwise arithmetic as ``_muon_step``), so
        no buffer of the partition's size is added to DeepSpeed's: one whole matrix at a time."""
        axis = self.zero
        assert axis is not None
        mu, lr = group["momentum"], group["lr"]
        buf = _momentum(self.state[flat], grad, mu)
        flat.mul_(1 - lr * group["weight_decay"])
        for shape, fragment in self.fragments(flat, group):
            owner = next(self.owners) % axis.size
            whole = torch.zeros(math.prod(shape), dtype=flat.dtype, device=flat.device)
            if fragment is not None:
                at, flat_at, n = fragment  # where it starts in the matrix and in the flat, its length
                whole.narrow(0, at, n).copy_(grad.narrow(0, flat_at, n)).add_(buf.narrow(0, flat_at, n), alpha=mu)
            axis.reduce(whole, owner)
            if axis.rank == owner:
                whole.copy_(orthogonalize(whole.view(shape)).mul_(update_scale(shape)).reshape(-1))
            axis.broadcast(whole, owner)
            if fragment is not None:
                flat.narrow(0, flat_at, n).add_(whole.narrow(0, at, n), alpha=-lr)


def _momentum(state: dict[str, Any], grad: torch.Tensor, mu: float) -> torch.Tensor:
    """M = mu M + G (``momentum_buffer``, created at zero)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
    return state["momentum_buffer"].mul_(mu).add_(grad)


def _momentum_input(state: dict[str, Any], grad: torch.Tensor, mu: float) -> torch.Tensor:
    """M = mu M + G, and the Nesterov input G + mu M."""
    return grad.add(_momentum(state, grad, mu), alpha=mu)


def _orthogonalize_sharded(u: torch.Tensor, shard: MatrixShard) -> torch.Tensor:
    """This rank's slice of NS5 of the whole matrix: slices gathered to the owner, orthogonalised and scaled there,
    scattered back (two collectives on ``shard.axis``, each counted there)."""
    axis = shard.axis
    parts = axis.gather(u.contiguous(), shard.owner)
    chunks = None
    if parts is not None:
        whole = torch.cat(parts, dim=shard.dim)
        full = orthogonalize(whole).mul_(update_scale(tuple(whole.shape)))
        chunks = [c.contiguous() for c in full.chunk(axis.size, dim=shard.dim)]
    return axis.scatter(chunks, torch.empty_like(u), shard.owner)


def build_muon(groups: list[dict[str, Any]], o: OptimConfig, shards: dict[int, MatrixShard] | None = None,
               zero: AxisGroup | None = None) -> torch.optim.Optimizer:
    """The ``muon`` entry's optimizer: Muon (momentum ``optim.momentum``) on the groups marked ``use_muon``, AdamW
    (``optim.beta1``/``beta2``/``eps``) on the rest, each group's weight decay."""
    return Muon(groups, lr=o.lr, momentum=o.momentum, betas=(o.beta1, o.beta2), eps=o.eps, shards=shards, zero=zero)


def build_sgd(groups: list[dict[str, Any]], o: OptimConfig,
              shards: dict[int, MatrixShard] | None = None) -> torch.optim.Optimizer:
    """The ``sgd`` entry's: torch's SGD with heavy-ball momentum ``optim.momentum`` (its weight decay is L2, added to
    the gradient, as torch's SGD does)."""
    return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, foreach=False)
