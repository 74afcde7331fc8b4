"""The router's maths: scores, the top-k choice, the gates, capacity or dropless placement, the auxiliary losses.

Pure torch, functions of the router logits alone, so routing is the same in every layout (``model_moe.py`` uses
them; docs/moe.md).

Choice and gates (``select``):

- scores: softmax over the experts (Mixtral, Qwen-MoE) or a sigmoid per expert (DeepSeek-V3, arXiv 2412.19437
  eq. 15);
- the choice reads the scores plus the expert bias when the model has one (DeepSeek-V3's auxiliary-loss-free
  balancing, eq. 16: for selection only, never in a gate), limited to the ``router_topk_groups`` best of
  ``router_groups`` expert groups when there are several, a group scored by the sum of its two best experts
  (DeepSeek-V3's node-limited routing as transformers' DeepseekV3TopkRouter computes it);
- the gates are the chosen experts' scores, renormalised to sum to 1 when ``norm_topk_prob`` (Mixtral always;
  Qwen2-MoE not by default), times ``routed_scaling_factor``.

Placement: with a capacity (``capacity_route``) GShard's slots per expert and sequence, claimed choice-major then
by position, so which assignment is dropped depends on the sequence alone; dropless (``sort_by_expert``) every
assignment, sorted by expert for the grouped computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dist_trainer.config import ModelConfig


@dataclass
class Choice:
    """Every token's k experts and their gates (``select``)."""

    expert: torch.Tensor  # (B, T, k) int64, by descending score
    gate: torch.Tensor  # (B, T, k) fp32, carries the router's gradient
    scores: torch.Tensor  # (B, T, E) fp32: softmax probabilities or sigmoid scores


def select(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None) -> Choice:
    """(B, T, E) fp32 router logits -> each token's top-k experts and gates (module docstring)."""
    scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
    choice = scores.detach() if bias is None else scores.detach() + bias
    if cfg.router_groups > 1:
        groups = choice.unflatten(-1, (cfg.router_groups, -1))  # (B, T, G, E/G)
        best = groups.topk(2, dim=-1).values.sum(-1).topk(cfg.router_topk_groups, dim=-1).indices  # (B, T, g)
        mask = torch.zeros(groups.shape[:-1], dtype=torch.bool, device=logits.device).scatter_(-1, best, True)
        choice = choice.masked_fill(~mask.repeat_interleave(groups.shape[-1], dim=-1), float("-inf"))
    expert = choice.topk(cfg.top_k, dim=-1).indices
    gate = scores.gather(-1, expert)
    if cfg.norm_topk_prob:
        gate = gate / (gate.sum(-1, keepdim=True) + 1e-20)  # DeepSeek-V3's 1e-20: sigmoid scores may all be ~0
    if cfg.routed_scaling_factor != 1.0:
        gate = gate * cfg.routed_scaling_factor
    return Choice(expert, gate, scores)


# ---------------------------------------------------------------- capacity routing


@dataclass
class Routing:
    """Where each (sequence, choice, position) assignment goes with a capacity; ``capacity_route`` computes it."""

    expert: torch.Tensor  # (B, k, T) int64: the chosen expert
    keep: torch.Tensor  # (B, k, T) bool: within the expert's capacity
    gate: torch.Tensor  # (B, k, T) fp32
    rows: torch.Tensor  # (B*k*T,) int64: row of the flat (E*B*capacity + 1, d) buffer; dropped -> the last row
    capacity: int


def capacity_route(c: Choice, n_experts: int, capacity: int) -> Routing:
    """GShard's slots (module docstring): the assignments of a sequence claim them choice-major, then by position
    (every token's first choice before any second: GShard's Algorithm 1, DeepSpeed's top2gating)."""
    B, T, k = c.expert.shape
    expert = c.expert.transpose(1, 2).contiguous()  # (B, k, T): choice-major order, then position
    onehot = F.one_hot(expert.view(B, k * T), n_experts)  # (B, k*T, E)
    slot = ((onehot.cumsum(1) - 1) * onehot).sum(-1).view(B, k, T)  # the assignment's place in its expert
    keep = slot < capacity
    seq = torch.arange(B, device=expert.device).view(B, 1, 1)
    rows = torch.where(keep, (expert * B + seq) * capacity + slot, n_experts * B * capacity)  # (E, B, capacity)
    return Routing(expert, keep, c.gate.transpose(1, 2), rows.flatten(), capacity)


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


# ---------------------------------------------------------------- dropless routing


def sort_by_expert(expert: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, k) choices -> (order, counts): ``order`` (B*T*k,) the assignments (token-major) sorted by expert, stably
    (a token's rows keep their order inside an expert), ``counts`` (E,) the assignments of each expert."""
    flat = expert.flatten()
    return flat.argsort(stable=True), torch.bincount(flat, minlength=n_experts)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The index that undoes ``order`` (gathering by it keeps only an index for backward; ``index_copy`` would keep
    its whole source)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def dropless_combine(out: torch.Tensor, order: torch.Tensor, gate: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B*T*k, d) outputs in expert order -> (B, T, d): back in token order, each token's k weighted and summed."""
    B, T, k = gate.shape
    unsorted = out.index_select(0, inverse_permutation(order)).view(B, T, k, -1)
    return (unsorted * gate.unsqueeze(-1)).sum(2).to(like.dtype)


# ---------------------------------------------------------------- auxiliary losses


def load_balancing_loss(scores: torch.Tensor, expert: torch.Tensor, n_experts: int, *, per_sequence: bool,
                        normalise: bool) -> torch.Tensor:
    """Switch Transformer eq. 4, N sum_i f_i P_i (1 under uniform routing), over the micro-batch or per sequence
    and averaged (DeepSeek-V3 eq. 17-20: f_i the share of the sequence's assignments to expert i times N, here
    over all k choices as Megatron's top-k gate does; P_i the mean score, sigmoid scores first ``normalise``d to
    sum to 1 per token).

    ``scores`` (B, T, E) router probabilities or scores; ``expert`` (B, T, k) the choices."""
    if normalise:
        scores = scores / scores.sum(-1, keepdim=True)
    if not per_sequence:
        scores, expert = scores.flatten(0, 1).unsqueeze(0), expert.flatten(0, 1).unsqueeze(0)
    onehot = F.one_hot(expert.flatten(1), n_experts).to(scores.dtype)  # (S, T*k, E)
    f = onehot.mean(1)  # (S, E): share of each sequence's assignments
    return n_experts * (f * scores.mean(1)).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE eq. 5: the mean over tokens of log(sum_j exp(x_j))^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()
