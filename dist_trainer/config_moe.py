"""Validation of the ``model`` section's mixture-of-experts fields (``config_model.ModelConfig``; docs/moe.md)."""

from __future__ import annotations

from typing import Any

from dist_trainer.config_fields import choice, is_number, positive

ROUTER_SCORES = ("softmax", "sigmoid")  # model.router_score
AUX_LOSS_SCOPES = ("batch", "sequence")  # model.router_aux_loss_scope


def validate_moe(cfg: Any) -> None:
    """ValueError naming the first MoE field of ``cfg`` (a ModelConfig) that is out of range."""
    for name in ("n_experts", "n_shared_experts"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.{name}={value!r} must be an integer >= 0")
    if cfg.n_experts == 0:
        if cfg.n_shared_experts:
            raise ValueError(f"model.n_shared_experts={cfg.n_shared_experts} needs routed experts "
                             "(model.n_experts > 0)")
        return
    positive(cfg, "top_k", "moe_every", "router_groups", "router_topk_groups")
    if cfg.moe_d_ff is not None:
        positive(cfg, "moe_d_ff")
    choice(cfg, "router_score", ROUTER_SCORES)
    choice(cfg, "router_aux_loss_scope", AUX_LOSS_SCOPES)
    if cfg.top_k > cfg.n_experts:
        raise ValueError(f"model.top_k={cfg.top_k} exceeds model.n_experts={cfg.n_experts}")
    if cfg.capacity_factor is not None and (not is_number(cfg.capacity_factor) or cfg.capacity_factor <= 0):
        raise ValueError(f"model.capacity_factor={cfg.capacity_factor!r} must be > 0, or none (dropless; "
                         f">= n_experts / top_k = {cfg.n_experts / cfg.top_k:g} never drops a token either)")
    if cfg.router_aux_loss < 0 or cfg.router_z_loss < 0:
        raise ValueError(f"model.router_aux_loss={cfg.router_aux_loss} and model.router_z_loss="
                         f"{cfg.router_z_loss} must be >= 0")
    _validate_groups(cfg)
    for name in ("norm_topk_prob", "expert_bias", "shared_expert_gate"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"model.{name}={getattr(cfg, name)!r} must be true or false")
    if not is_number(cfg.routed_scaling_factor) or cfg.routed_scaling_factor <= 0:
        raise ValueError(f"model.routed_scaling_factor={cfg.routed_scaling_factor!r} must be > 0")
    if not is_number(cfg.moe_bias_update_rate) or cfg.moe_bias_update_rate < 0:
        raise ValueError(f"model.moe_bias_update_rate={cfg.moe_bias_update_rate!r} must be >= 0")
    if cfg.moe_bias_update_rate and not cfg.expert_bias:
        raise ValueError(f"model.moe_bias_update_rate={cfg.moe_bias_update_rate} updates the expert bias: it needs "
                         "model.expert_bias: true")
    if cfg.shared_expert_gate and not cfg.n_shared_experts:
        raise ValueError("model.shared_expert_gate=true gates the shared expert: it needs model.n_shared_experts > 0")
    bad = [i for i in cfg.moe_dense_layers if not isinstance(i, int) or isinstance(i, bool)
           or not 0 <= i < cfg.n_layers]
    if bad:
        raise ValueError(f"model.moe_dense_layers={cfg.moe_dense_layers!r}: {bad} are not layer indices "
                         f"0 .. {cfg.n_layers - 1}")


def _validate_groups(cfg: Any) -> None:
    """Group-limited routing (DeepSeek-V3): equal groups, enough experts in the chosen ones for top_k."""
    groups, chosen = cfg.router_groups, cfg.router_topk_groups
    if groups == 1 and chosen == 1:
        return
    if cfg.n_experts % groups or chosen > groups:
        raise ValueError(f"model.router_groups={groups} must divide model.n_experts={cfg.n_experts} and be >= "
                         f"model.router_topk_groups={chosen}")
    per = cfg.n_experts // groups
    if per < 2 or chosen * per < cfg.top_k:
        raise ValueError(f"model.router_topk_groups={chosen} groups of {per} experts (n_experts / router_groups) "
                         f"cannot hold model.top_k={cfg.top_k} choices, or a group has fewer than 2 experts "
                         "(a group scores by its 2 best)")
