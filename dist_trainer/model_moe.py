"""Mixture-of-experts feed-forward layer: router, experts, expert capacity, auxiliary losses. Pure torch.

A layer ``i`` with ``cfg.is_moe_layer(i)`` holds ``moe`` where a dense layer holds ``mlp``:

  layers.{i}.moe.router                             Linear(d_model, n_experts, bias=False), computed in fp32
  layers.{i}.moe.experts.{e}.{up,gate,down}_proj    expert ``e`` (its GLOBAL index) is the model's own MLP
  layers.{i}.moe.shared_expert.{up,gate,down}_proj  optional: an MLP n_shared_experts x d_ff wide, every token

Routing is one function (``route``) of the router logits, so it is the same in every layout:

1. softmax over the experts, top-k, the k gates renormalised to sum to 1 (Mixtral, Jiang et al. 2024, eq. 2;
   Megatron-core's default softmax-after-top-k gives the same numbers; with k = 1 the gate is 1);
2. expert capacity ``cfg.expert_capacity(T)`` slots per expert and *sequence* (GShard's groups, Lepikhin et al.
   2020, with one group per sequence): the assignments of a sequence claim slots choice-major, then by position
   (every token's first choice before any second choice: GShard's Algorithm 1, DeepSpeed's top2gating), so
   which tokens are dropped depends on the sequence alone, not on the micro-batch, the dp/ep/tp/pp layout or
   sequence parallelism;
3. an assignment beyond capacity is dropped: the token keeps its other experts' outputs (gates not renormalised
   again) and its residual stream.

The experts run on a dispatch buffer (E, sequences x capacity, d_model) through ``MoE.run_experts``; expert
parallelism (``parallel/ep/``) rebinds it to move the buffer with all-to-all. Padded slots are computed too, as
in every capacity-based implementation (the planner charges them).

Training adds, per MoE layer, ``router_aux_loss`` x the Switch load-balancing loss (Fedus et al. 2021, eq. 4-6:
N sum_i f_i P_i, f_i the share of the micro-batch's assignments routed to expert i before capacity, all k choices
counted and divided by k as Megatron and DeepSpeed's top-k gate do; P_i the mean router probability) and
``router_z_loss`` x the router z-loss (Zoph et al. 2022, eq. 5: the mean squared log-sum-exp of the logits).
``add_aux_losses`` adds them to the LM loss (the model's forward); a pipeline stage attaches them to its output
with ``attach_aux_losses`` instead (Megatron's MoEAuxLossAutoScaler). Evaluation reports the LM loss alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dist_trainer.config import ModelConfig

# RouterStats columns after the n_experts token counts
DROPPED, AUX, Z, CALLS = range(4)


@dataclass
class Routing:
    """Where each (sequence, choice, position) assignment goes; ``route`` computes it."""

    expert: torch.Tensor  # (B, k, T) int64: the chosen expert
    keep: torch.Tensor  # (B, k, T) bool: within the expert's capacity
    gate: torch.Tensor  # (B, k, T) fp32: the renormalised gate (carries the router's gradient)
    rows: torch.Tensor  # (B*k*T,) int64: row of the flat (E*B*capacity + 1, d) buffer; dropped -> the last row
    capacity: int


def route(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """(B, T, E) fp32 router logits -> the routing of every token (module docstring: steps 1-3)."""
    B, T, E = logits.shape
    top_p, top_e = logits.softmax(-1).topk(top_k, dim=-1)  # (B, T, k)
    gate = (top_p / top_p.sum(-1, keepdim=True)).transpose(1, 2)  # (B, k, T)
    expert = top_e.transpose(1, 2).contiguous()  # (B, k, T): choice-major order, then position
    onehot = F.one_hot(expert.view(B, top_k * T), E)  # (B, k*T, E)
    slot = ((onehot.cumsum(1) - 1) * onehot).sum(-1).view(B, top_k, T)  # the assignment's place in its expert
    keep = slot < capacity
    seq = torch.arange(B, device=logits.device).view(B, 1, 1)
    rows = torch.where(keep, (expert * B + seq) * capacity + slot, E * B * capacity)  # buffer (E, B, capacity)
    return Routing(expert, keep, gate, rows.flatten(), capacity)


def dispatch(x: torch.Tensor, r: Routing, n_experts: int) -> torch.Tensor:
    """(B, T, d) tokens -> (E, B*capacity, d) expert inputs; empty slots are zeros."""
    B, T, d = x.shape
    k = r.expert.shape[1]
    src = x.unsqueeze(1).expand(B, k, T, d).reshape(B * k * T, d)
    # one spill row takes every dropped assignment, then is cut off (slicing the end keeps it contiguous)
    buf = x.new_zeros(n_experts * B * r.capacity + 1, d).index_put((r.rows,), src)
    return buf[:-1].view(n_experts, B * r.capacity, d)


def combine(out: torch.Tensor, r: Routing, like: torch.Tensor) -> torch.Tensor:
    """(E, B*capacity, d) expert outputs -> (B, T, d): each token's kept outputs weighted by their gates."""
    B, k, T = r.expert.shape
    flat = out.reshape(-1, out.shape[-1])
    picked = flat.index_select(0, r.rows.clamp(max=flat.shape[0] - 1)).view(B, k, T, -1)
    weight = (r.gate * r.keep).unsqueeze(-1)  # a dropped assignment contributes nothing (and gets no gradient)
    return (picked * weight).sum(1).to(like.dtype)


def load_balancing_loss(probs: torch.Tensor, expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer eq. 4: N sum_i f_i P_i over the micro-batch (1 under uniform routing).

    ``probs`` (tokens, E) router probabilities; ``expert`` every assignment's expert (all k choices)."""
    f = torch.bincount(expert.flatten(), minlength=n_experts).to(probs.dtype) / expert.numel()
    return n_experts * (f * probs.mean(0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE eq. 5: the mean over tokens of log(sum_j exp(x_j))^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def _in_backward() -> bool:
    """True while autograd runs a backward (an activation-checkpointed layer recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


class ExpertExchange(nn.Module):
    """Where the experts' rows travel: nowhere in one process, every expert being here. The declared seam of expert
    parallelism, which swaps in its all-to-all (``parallel/ep/apply.py``): ``send`` takes the (E, N, d) dispatch
    buffer to the rows of this rank's experts, ``receive`` takes their outputs back to (E, N, d)."""

    def send(self, buf: torch.Tensor) -> torch.Tensor:
        return buf

    def receive(self, out: torch.Tensor) -> torch.Tensor:
        return out


class MoE(nn.Module):
    """Top-k routed experts with capacity (module docstring); the same module in every regime.

    ``router_stats`` accumulates, over the training forwards since ``reset_stats``, the assignments per expert
    (before capacity), the dropped assignments and the coefficient-weighted aux and z losses (float64, on the
    layer's device): the per-layer load metrics of metrics.jsonl.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id  # the global layer index (pipeline stages keep it)
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)  # Mixtral, Switch: no bias
        self.experts = nn.ModuleDict({str(e): make_mlp(cfg.ffn_dim) for e in range(cfg.n_experts)})
        self.shared_expert = make_mlp(cfg.n_shared_experts * cfg.ffn_dim) if cfg.n_shared_experts else None
        self.exchange = ExpertExchange()  # expert parallelism's seam
        self.aux_loss: torch.Tensor | None = None  # the last training forward's weighted aux + z loss
        self.router_stats: torch.Tensor | None = None
        self.record_stats = True  # off while a pipeline schedule infers shapes (paused_router_stats)

    def run_experts(self, buf: torch.Tensor) -> torch.Tensor:
        """(E, N, d) dispatch buffer -> (E, N, d) outputs: the rows of this module's experts (all of them in one
        process) reach them through ``exchange``, expert i (ModuleDict order) runs on row block i, and back."""
        rows = self.exchange.send(buf)
        out = torch.stack([expert(rows[i]) for i, expert in enumerate(self.experts.values())])
        return self.exchange.receive(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # the router in fp32 (Switch, section 2.4)
            logits = self.router(x).float()  # (B, T, E)
        r = route(logits, self.top_k, self.cfg.expert_capacity(x.shape[1]))
        y = combine(self.run_experts(dispatch(x, r, self.n_experts)), r, x)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        if self.training:
            flat = logits.flatten(0, 1)
            aux = self.cfg.router_aux_loss * load_balancing_loss(flat.softmax(-1), r.expert, self.n_experts)
            z = self.cfg.router_z_loss * z_loss(flat)
            self.aux_loss = aux + z
            if self.record_stats and not _in_backward():  # a recomputed forward: the same tokens again
                self._record(r, aux, z)
        return y

    @torch.no_grad()
    def _record(self, r: Routing, aux: torch.Tensor, z: torch.Tensor) -> None:
        if self.router_stats is None:
            self.reset_stats(r.gate.device)
        assert self.router_stats is not None
        E = self.n_experts
        self.router_stats[:E] += torch.bincount(r.expert.flatten(), minlength=E).double()
        extra = torch.stack([(~r.keep).sum().double(), aux.double(), z.double(), torch.ones((), device=aux.device,
                                                                                              dtype=torch.float64)])
        self.router_stats[E:] += extra

    def reset_stats(self, device: torch.device | None = None) -> None:
        device = device or self.router.weight.device
        self.router_stats = torch.zeros(self.n_experts + 4, dtype=torch.float64, device=device)


def moe_layers(model: nn.Module) -> Iterator[MoE]:
    """The MoE layers of ``model`` (a whole model, a pipeline stage or a rank's stages), in module order."""
    return (m for m in model.modules() if isinstance(m, MoE))


def add_aux_losses(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` plus the weighted aux and z losses of the MoE layers' last training forward (what the model's
    forward returns in training); the stored terms are cleared so none is counted twice."""
    for m in moe_layers(model):
        if m.aux_loss is not None:
            loss = loss + m.aux_loss.to(loss.dtype)
            m.aux_loss = None
    return loss


class _AttachAux(torch.autograd.Function):
    """Forward: ``x`` unchanged. Backward: ``x``'s gradient, and 1 for ``aux`` (Megatron-core's
    MoEAuxLossAutoScaler), so the aux losses of a pipeline stage train its routers without riding the loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_shape
        return grad, torch.ones(shape, dtype=dtype, device=device)


def attach_aux_losses(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` carrying the gradient of this module's MoE aux losses (training; a no-op without MoE layers).

    The pipeline schedule backpropagates each micro-batch's unscaled loss and divides the gradients by the
    micro-batches afterwards, so a scale of 1 matches the single model's ``(loss + aux) / n``."""
    zero = x.new_zeros((), dtype=torch.float32)
    total = add_aux_losses(model, zero)
    return x if total is zero else _AttachAux.apply(x, total)


@contextlib.contextmanager
def paused_router_stats(model: nn.Module) -> Iterator[None]:
    """Forwards inside do not count in ``router_stats`` (a pipeline schedule's shape-inference forward)."""
    layers = list(moe_layers(model))
    for m in layers:
        m.record_stats = False
    try:
        yield
    finally:
        for m in layers:
            m.record_stats = True


def reset_router_stats(model: nn.Module) -> None:
    for m in moe_layers(model):
        m.reset_stats()


def aux_loss_sum(model: nn.Module) -> float:
    """The weighted aux + z losses recorded since the last reset, summed over layers and forwards."""
    return float(sum(float(m.router_stats[m.n_experts + AUX] + m.router_stats[m.n_experts + Z])
                     for m in moe_layers(model) if m.router_stats is not None))
