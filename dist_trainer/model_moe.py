"""Mixture-of-experts feed-forward layer: router, experts, shared expert, expert bias, auxiliary losses. Pure torch.

A layer ``i`` with ``cfg.is_moe_layer(i)`` holds ``moe`` where a dense layer holds ``mlp``:

  layers.{i}.moe.router                             Linear(d_model, n_experts, bias=False), computed in fp32
  layers.{i}.moe.expert_bias                        buffer (n_experts,) fp32 with model.expert_bias (DeepSeek-V3)
  layers.{i}.moe.experts.{e}.{up,gate,down}_proj    expert ``e`` (its GLOBAL index): an MLP moe_d_ff wide
  layers.{i}.moe.shared_expert.{up,gate,down}_proj  optional: an MLP n_shared_experts x moe_d_ff wide, every token
  layers.{i}.moe.shared_expert_gate                 optional: Linear(d_model, 1, bias=False) (Qwen-MoE)

Routing is a function of the router logits alone (``model_moe_routing.py``: scores, top-k, gates), so it is the
same in every layout. Then either

- dropless (``capacity_factor: none``, the default): every assignment, sorted by expert, runs through its expert
  (``model_moe_experts.py``: grouped matmuls or a segment loop) and comes back weighted by its gate; under expert
  parallelism the seam ``exchange`` moves the sorted rows with an uneven all-to-all (``parallel/ep/``);
- or with a capacity: GShard's dispatch buffer (E, sequences x capacity, d_model), an assignment beyond its
  expert's capacity dropped (the token keeps its other experts' outputs and its residual stream); padded slots are
  computed too, as in every capacity-based implementation.

The shared expert adds its output for every token (times sigmoid of its gate with Qwen-MoE's gate).

Training adds, per MoE layer, ``router_aux_loss`` x the load-balancing loss (Switch, Fedus et al. 2021 eq. 4 over
the micro-batch, or per sequence: ``router_aux_loss_scope``) and ``router_z_loss`` x the router z-loss (Zoph et
al. 2022, eq. 5). ``add_aux_losses`` adds them to the LM loss (the model's forward); a pipeline stage attaches
them to its output with ``attach_aux_losses`` instead (Megatron's MoEAuxLossAutoScaler). Evaluation reports the
LM loss alone. The expert bias is nudged after each optimizer step (``moe_balance.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dist_trainer.config import ModelConfig
from dist_trainer.model_moe_experts import run_experts_sorted
from dist_trainer.model_moe_routing import (
    Choice,
    capacity_route,
    combine,
    dispatch,
    dropless_combine,
    load_balancing_loss,
    select,
    sort_by_expert,
    z_loss,
)

# RouterStats columns after the n_experts token counts
DROPPED, AUX, Z, CALLS = range(4)


def _in_backward() -> bool:
    """True while autograd runs a backward (an activation-checkpointed layer recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


class ExpertExchange(nn.Module):
    """Where the experts' rows travel: nowhere in one process, every expert being here. The declared seam of expert
    parallelism, which swaps in its all-to-alls (``parallel/ep/apply.py``).

    Capacity routing: ``send`` takes the (E, N, d) dispatch buffer to the rows of this rank's experts, ``receive``
    takes their outputs back to (E, N, d). Dropless: ``send_sorted`` takes (rows sorted by expert, rows per
    expert) to this rank's experts' rows sorted by its own experts and their counts, plus what ``receive_sorted``
    needs to send their outputs back in the original order."""

    def send(self, buf: torch.Tensor) -> torch.Tensor:
        return buf

    def receive(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def send_sorted(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return rows, counts, None

    def receive_sorted(self, out: torch.Tensor, handle: Any) -> torch.Tensor:
        return out


class MoE(nn.Module):
    """Top-k routed experts, dropless or with capacity, and the shared expert (module docstring); the same module
    in every regime.

    ``router_stats`` accumulates, over the training forwards since ``reset_stats``, the assignments per expert
    (before capacity), the dropped assignments and the coefficient-weighted aux and z losses (float64, on the
    layer's device): the per-layer load metrics of metrics.jsonl. ``step_load`` counts the assignments per expert
    since the last expert-bias update (``moe_balance.update_expert_bias``).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id  # the global layer index (pipeline stages keep it)
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)  # Mixtral, Switch: no bias
        # DeepSeek-V3's e_score_correction_bias: selection only, no gradient, saved with the model
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts) if cfg.expert_bias else None)
        self.experts = nn.ModuleDict({str(e): make_mlp(cfg.expert_ffn_dim) for e in range(cfg.n_experts)})
        shared = cfg.n_shared_experts * cfg.expert_ffn_dim
        self.shared_expert = make_mlp(shared) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_expert_gate else None
        self.exchange = ExpertExchange()  # expert parallelism's seam
        self.grouped = True  # dropless experts as grouped matmuls where supported (benchmarks/moe_grouped.py)
        self.aux_loss: torch.Tensor | None = None  # the last training forward's weighted aux + z loss
        self.router_stats: torch.Tensor | None = None
        self.step_load: torch.Tensor | None = None
        self.record_stats = True  # off while a pipeline schedule infers shapes (paused_router_stats)

    def run_experts(self, buf: torch.Tensor) -> torch.Tensor:
        """(E, N, d) dispatch buffer -> (E, N, d) outputs: the rows of this module's experts (all of them in one
        process) reach them through ``exchange``, expert i (ModuleDict order) runs on row block i, and back."""
        rows = self.exchange.send(buf)
        out = torch.stack([expert(rows[i]) for i, expert in enumerate(self.experts.values())])
        return self.exchange.receive(out)

    def run_dropless(self, x: torch.Tensor, c: Choice) -> torch.Tensor:
        """Every assignment through its expert: sorted by expert, exchanged, computed, back, weighted, summed."""
        order, counts = sort_by_expert(c.expert, self.n_experts)
        rows = x.flatten(0, 1).index_select(0, order // self.top_k)  # (B*T*k, d) in expert order
        here, here_counts, handle = self.exchange.send_sorted(rows, counts)
        out = run_experts_sorted(list(self.experts.values()), here, here_counts, grouped=self.grouped)
        return dropless_combine(self.exchange.receive_sorted(out, handle), order, c.gate, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # the router in fp32 (Switch, section 2.4)
            logits = self.router(x).float()  # (B, T, E)
        c = select(logits, self.cfg, self.expert_bias)
        dropped = None
        if self.cfg.dropless:
            y = self.run_dropless(x, c)
        else:
            r = capacity_route(c, self.n_experts, self.cfg.expert_capacity(x.shape[1]))
            y = combine(self.run_experts(dispatch(x, r, self.n_experts)), r, x)
            dropped = (~r.keep).sum()
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        if self.training:
            aux = self.cfg.router_aux_loss * load_balancing_loss(
                c.scores, c.expert, self.n_experts, per_sequence=self.cfg.router_aux_loss_scope == "sequence",
                normalise=self.cfg.router_score == "sigmoid") if self.cfg.router_aux_loss else logits.new_zeros(())
            z = self.cfg.router_z_loss * z_loss(logits.flatten(0, 1)) if self.cfg.router_z_loss else \
                logits.new_zeros(())
            self.aux_loss = aux + z
            if self.record_stats and not _in_backward():  # a recomputed forward: the same tokens again
                self._record(c, dropped, aux, z)
        return y

    @torch.no_grad()
    def _record(self, c: Choice, dropped: torch.Tensor | None, aux: torch.Tensor, z: torch.Tensor) -> None:
        if self.router_stats is None or self.step_load is None:
            self.reset_stats(c.gate.device)
        assert self.router_stats is not None and self.step_load is not None
        E = self.n_experts
        load = torch.bincount(c.expert.flatten(), minlength=E).double()
        self.router_stats[:E] += load
        self.step_load += load
        zero = torch.zeros((), device=aux.device, dtype=torch.float64)
        extra = torch.stack([zero if dropped is None else dropped.double(), aux.double(), z.double(), zero + 1])
        self.router_stats[E:] += extra

    def buffer_specs(self) -> dict[str, tuple[int | None, int | None]]:
        """The buffers that are model state, as checkpoints merge them (``parallel/tp/reshard.tp_shard_specs``):
        the expert bias, whole on every rank."""
        return {"expert_bias": (None, None)} if self.expert_bias is not None else {}

    @torch.no_grad()
    def reset_expert_bias(self) -> None:
        """Zero the expert bias (its initial value; also after ``to_empty`` left it uninitialised)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def reset_stats(self, device: torch.device | None = None) -> None:
        device = device or self.router.weight.device
        self.router_stats = torch.zeros(self.n_experts + 4, dtype=torch.float64, device=device)
        if self.step_load is None or self.step_load.device != device:
            self.step_load = torch.zeros(self.n_experts, dtype=torch.float64, device=device)


def moe_layers(model: nn.Module) -> Iterator[MoE]:
    """The MoE layers of ``model`` (a whole model, a pipeline stage or a rank's stages), in module order."""
    return (m for m in model.modules() if isinstance(m, MoE))


def expert_bias_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The MoE layers' expert-bias buffers by their ``state_dict`` names (model state beside the parameters)."""
    return {name: buf for name, buf in model.named_buffers() if name.endswith("moe.expert_bias")}


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
