"""apply_expert_parallel: keep this rank's experts of every MoE layer and route tokens to the others by all-to-all.

Rank r of the ep axis keeps experts [r E/ep, (r + 1) E/ep) under their global names (``moe.experts.{e}``), so
checkpoints, optimizer states and the planner see the same names in every layout. The layer's declared seam
``exchange`` (``model_moe.ExpertExchange``) becomes an ``AllToAllExchange``: the (E, N, d) dispatch buffer is cut
into ep chunks of E/ep experts, chunk i goes to ep rank i, each rank runs its experts on the ep x N rows it
received, and the outputs go back the same way (two all-to-alls forward, two backward: Lepikhin et al. 2020,
section 2.2; DeepSpeed-MoE's MOELayer). Dropless, the rows sorted by expert go out in uneven splits: the rows per
expert first (one all-to-all of E counts), then the rows, which arrive by source rank and are regrouped by this
rank's experts for the grouped computation, and go back the same way (Megatron-core's AlltoAll token dispatcher).

The kept experts' parameters follow DeepSpeed's convention (deepspeed/moe/experts.py): ``allreduce = False`` and
``group_name = "ep_size_{ep}"``, plus this project's ``ep_expert``: their gradients are reduced over the
expert-data-parallel group (``grad.py``), never over the whole dp group. At ep_size 1 nothing changes: the
experts are ordinary parameters of an ordinary model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_trainer.model_blocks import set_attrs
from dist_trainer.model_moe import ExpertExchange, moe_layers
from dist_trainer.model_moe_routing import inverse_permutation
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.ep.comms import all_to_all, all_to_all_uneven
from dist_trainer.parallel.state import ParallelState


def local_experts(n_experts: int, ep_size: int, ep_rank: int) -> range:
    """Global indices of the experts ep rank ``ep_rank`` holds: a contiguous block of n_experts / ep_size."""
    per = n_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def group_name(ep_size: int) -> str:
    """DeepSpeed's expert group name (deepspeed/moe/layer.py: ``f"ep_size_{ep_size}"``)."""
    return f"ep_size_{ep_size}"


def is_expert_param(p: nn.Parameter) -> bool:
    """A parameter of an expert split by expert parallelism (its gradient is reduced over edp only)."""
    return getattr(p, "ep_expert", False)


def apply_expert_parallel(model: nn.Module, state: ParallelState) -> nn.Module:
    """Drop the experts other ep ranks hold from every MoE layer of ``model`` (plain or TP, a whole model or a
    pipeline stage, fully initialised), tag the kept ones, swap in the all-to-all exchange; return ``model``."""
    ep = state.ep
    if ep.size == 1:
        return model
    for layer in moe_layers(model):
        keep = {str(e) for e in local_experts(layer.n_experts, ep.size, ep.rank)}
        for name in [n for n in layer.experts if n not in keep]:
            del layer.experts[name]
        for p in layer.experts.parameters():
            set_attrs(p, ep_expert=True, allreduce=False, group_name=group_name(ep.size))
        layer.exchange = AllToAllExchange(ep, layer.n_experts)
    return model


class AllToAllExchange(ExpertExchange):
    """The rows of each expert to the ep rank holding it and the outputs back: two all-to-alls forward, two
    backward (Lepikhin et al. 2020, section 2.2)."""

    def __init__(self, group: AxisGroup, n_experts: int) -> None:
        super().__init__()
        self.group, self.n_experts = group, n_experts

    def send(self, buf: torch.Tensor) -> torch.Tensor:
        """(E, N, d) this rank's dispatch buffer -> (E/ep, ep x N, d): every source's slots for this rank's experts."""
        E, N, d = buf.shape
        here = E // self.group.size
        recv = all_to_all(buf, self.group)  # chunk i: source i's slots for this rank's experts
        return recv.view(self.group.size, here, N, d).transpose(0, 1).reshape(here, self.group.size * N, d)

    def receive(self, out: torch.Tensor) -> torch.Tensor:
        """(E/ep, ep x N, d) this rank's experts' outputs -> (E, N, d) every expert's outputs for this rank's tokens."""
        here, rows, d = out.shape
        N = rows // self.group.size
        back = out.view(here, self.group.size, N, d).transpose(0, 1).reshape(self.n_experts, N, d)  # chunk i: source i
        return all_to_all(back, self.group)

    def send_sorted(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(N, d) rows sorted by global expert and (E,) rows per expert -> (M, d) the rows of this rank's experts
        from every source, sorted by local expert, their (E/ep,) counts, and the handle ``receive_sorted`` needs."""
        ep = self.group.size
        here = self.n_experts // ep
        got_counts = self.group.all_to_all(counts).view(ep, here)  # row j: source j's rows for each expert here
        send = counts.view(ep, here).sum(1).tolist()
        recv = got_counts.sum(1).tolist()
        got = all_to_all_uneven(rows, self.group, send, recv, tokens_in=True)
        # source-major (j, e) segments -> expert-major (e, j): a stable sort of the rows by their expert
        segment = torch.repeat_interleave(torch.arange(ep * here, device=rows.device), got_counts.flatten())
        order = (segment % here).argsort(stable=True)
        return got.index_select(0, order), got_counts.sum(0), (send, recv, order)

    def receive_sorted(self, out: torch.Tensor, handle: Any) -> torch.Tensor:
        """This rank's experts' (M, d) outputs -> the (N, d) outputs of this rank's rows, in ``send_sorted``'s
        input order."""
        send, recv, order = handle
        by_source = out.index_select(0, inverse_permutation(order))
        return all_to_all_uneven(by_source, self.group, recv, send, tokens_in=False)
