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
expert its own, and orthogonalise them where they are. Under DeepSpeed's ZeRO-1/2 this is DeepSpeed's client
optimizer over flat fp32 partitions: each matrix is rebuilt on an owner dp rank from the ranks' fragments
(``Muon._zero_step``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class MatrixShard:
    """A matrix cut into equal contiguous slices along ``dim`` over ``axis``; ``owner`` orthogonalises it."""

    axis: AxisGroup
    dim: int
    owner: int


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked ``use_muon``, torch AdamW's arithmetic (fp32 moments) on the others.

    ``shards``: {id(parameter): MatrixShard} for the matrices this rank holds a slice of (module docstring).
    ``zero``: DeepSpeed's ZeRO-1/2 data-parallel axis when DeepSpeed wraps this optimizer: it then steps one flat
    fp32 partition per group, and each Muon matrix is rebuilt from the ranks' fragments on its owner (``_zero_step``).
    """

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, shards: dict[int, MatrixShard] | None = None,
                 zero: AxisGroup | None = None) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "use_muon": False})
        self.shards, self.zero = shards or {}, zero
        # the module's matrices per group, before DeepSpeed puts its flat partitions in their place
        self.matrices = [list(g["params"]) for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        owners = iter(range(10**9))  # matrix k of the step is owned by dp rank k mod dp (ZeRO)
        for group, p, grad in params_with_grads(self):
            if group["use_muon"] and self.zero is not None:
                self._zero_step(p, grad, group, owners)
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

    def _zero_step(self, flat: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], owners: Any) -> None:
        """One ZeRO-1/2 partition of a Muon group: the momentum on the partition (elementwise), then per matrix the
        ranks' fragments of U summed into its owner (a reduce of the zero-padded matrix over dp), orthogonalised and
        scaled there, broadcast, and this rank's fragment applied to its fp32 master partition. Each matrix's
        fragment is DeepSpeed's record (``_hp_mapping``: where it lies in the matrix and in the partition)."""
        axis = self.zero
        assert axis is not None
        u = _momentum_input(self.state[flat], grad, group["momentum"])
        update = torch.zeros_like(flat)
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        for p in self.matrices[index]:
            owner = next(owners) % axis.size
            whole = torch.zeros(p.numel(), dtype=u.dtype, device=u.device)
            fragment = getattr(p, "_hp_mapping", None)
            if fragment is not None:
                lp, hp = fragment.lp_fragment_address, fragment.hp_fragment_address
                whole.narrow(0, lp.start, lp.numel).copy_(u.narrow(0, hp.start, hp.numel))
            axis.reduce(whole, owner)
            if axis.rank == owner:
                matrix = whole.view(p.shape)
                whole.copy_(orthogonalize(matrix).mul_(update_scale(tuple(p.shape))).reshape(-1))
            axis.broadcast(whole, owner)
            if fragment is not None:
                update.narrow(0, hp.start, hp.numel).copy_(whole.narrow(0, lp.start, lp.numel))
        flat.mul_(1 - group["lr"] * group["weight_decay"])
        flat.add_(update, alpha=-group["lr"])


def _momentum_input(state: dict[str, Any], grad: torch.Tensor, mu: float) -> torch.Tensor:
    """M = mu M + G (``momentum_buffer``, created at zero), and the Nesterov input G + mu M."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
    buf = state["momentum_buffer"]
    buf.mul_(mu).add_(grad)
    return grad.add(buf, alpha=mu)


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
