"""DeepSpeed's MoE conventions, so that ZeRO-1/2 runs this project's expert-parallel model (DeepSpeed 0.19.8).

DeepSpeed reduces and partitions expert parameters apart from the dense ones only in an engine that knows it has
MoE layers, which it learns from ``isinstance(module, deepspeed.moe.layer.MoE)`` (runtime/engine.py,
``_configure_distributed_model``). What its own MoE layer would set up is set up here, for our groups:

1. ``register_expert_groups``: our ep and edp process groups under DeepSpeed's name ``ep_size_{ep}`` in
   ``deepspeed.utils.groups`` (what ``MoE.set_deepspeed_parallelism`` creates through
   ``_create_expert_and_data_parallel``); a one-rank edp (ep_size = dp_size) as a group of that rank alone;
2. ``mark_moe_model``: a parameter-free subclass of DeepSpeed's MoE under ``model.ds_moe_marker``, so the engine
   sets ``has_moe_layers``: expert gradients reduced over edp and divided by the dp world size
   (``_reduce_expert_gradients``), experts broadcast within edp only, ZeRO's MoE settings
   (stage_1_and_2.py ``_configure_moe_settings``: stage 2 needs contiguous_gradients, both need reduce_scatter);
3. ``moe_param_groups``: DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` on our AdamW groups
   (named ``decay`` and ``no_decay``), so each expert parameter sits in a group marked ``moe: True`` that ZeRO
   partitions over edp (``real_dp_process_group``); the expert parameters carry ``allreduce = False`` and
   ``group_name`` from ``apply_expert_parallel``;
4. ``state_by_name``: the full fp32 weights and AdamW moments of this rank's parameters by name (DeepSpeed's
   ``safe_get_full_*``, collective over each parameter's partition group), so a ZeRO + EP checkpoint is written
   in the by-name format every regime reads (DeepSpeed's own MoE checkpoint names experts its own way).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_trainer.model import set_attrs
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.ep.apply import group_name
from dist_trainer.parallel.state import ParallelState

MARKER = "ds_moe_marker"


def register_expert_groups(state: ParallelState) -> None:
    """Our ep / edp groups as DeepSpeed's expert groups of ``ep_size_{ep}`` (collective: every rank calls it)."""
    from deepspeed.utils import groups

    name = group_name(state.ep_size)
    alone = None
    if state.edp.size == 1:  # every rank is alone in its edp then: each creates every singleton, in rank order
        for r in range(state.world_size):
            g = dist.new_group([r])
            if r == state.rank:
                alone = g
    for table, ranks_table, axis, group in ((groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                                             state.ep, state.ep.group),
                                            (groups._EXPERT_DATA_PARALLEL_GROUP,
                                             groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, state.edp,
                                             state.edp.group or alone)):
        assert group is not None, f"no process group for the {axis.axis} axis"
        table[name] = group
        ranks_table[name] = list(axis.ranks)


def mark_moe_model(model: nn.Module, n_experts: int, ep: AxisGroup) -> None:
    """Attach the marker that tells DeepSpeed the model has MoE layers (module docstring, point 2)."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class ExpertParallelMarker(DeepSpeedMoE):
        """No parameters, never called: our MoE layers run the experts; DeepSpeed reads num_experts here."""

        def __init__(self) -> None:
            nn.Module.__init__(self)  # not DeepSpeedMoE.__init__: no gate, no experts of its own
            self.num_experts, self.ep_size = n_experts, ep.size
            self.num_local_experts = n_experts // ep.size
            self.expert_group_name = group_name(ep.size)

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups are ours, registered by register_expert_groups

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("ExpertParallelMarker only marks the model for DeepSpeed; it never runs")

    set_attrs(model, **{MARKER: ExpertParallelMarker()})


def moe_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our (decay, no-decay) AdamW groups with the expert parameters moved into DeepSpeed's MoE groups."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{**g, "name": name} for g, name in zip(groups, ("decay", "no_decay"), strict=True)]
    return split_params_into_different_moe_groups_for_optimizer(named)


def state_by_name(model: nn.Module, ds_optimizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(fp32 weights, {name: {step, exp_avg, exp_avg_sq}}) of every parameter this rank holds, whole.

    Collective: every rank walks its parameters in the same order, each gather running over that parameter's
    partition group (dp for dense parameters, edp for experts)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # ZeRO-1/2 link each parameter to its AdamW moments after the first group's first step (stage_1_and_2.py,
    # _lazy_init_hp_params_optimizer_state), before the other groups' moments exist: link again now they do
    ds_optimizer._hp_optimizer_states_linked = False
    ds_optimizer._lazy_init_hp_params_optimizer_state()
    base = ds_optimizer.optimizer
    step = next((s["step"] for s in base.state.values() if "step" in s), torch.tensor(0.0))
    weights: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        weights[name] = safe_get_full_fp32_param(p).detach().cpu()
        moments[name] = {"step": torch.as_tensor(step, dtype=torch.float32).clone().cpu(),
                         **{k: safe_get_full_optimizer_state(p, k).detach().cpu() for k in ("exp_avg", "exp_avg_sq")}}
    return weights, moments
