"""What the mixture-of-experts families share (torch-free): which layers are sparse, the ``moe`` block's recipes,
the router keys of config.json.

A sparse layer's block is HF ``{block}.{router}`` (our ``moe.router``), ``{block}.experts.{e}.{leaf}`` (our
``moe.experts.{e}.{leaf}``), and where the family has them ``{block}.shared_expert(s).{leaf}`` and
``{block}.shared_expert_gate``; a dense layer's ``mlp.{gate,up,down}_proj`` is ours under the same names.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families.common import refuse
from dist_trainer.families.recipe import Recipe

LEAVES = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj"))  # ours, theirs


def is_moe(m: dict[str, Any], i: int) -> bool:
    """ModelConfig.is_moe_layer of fields ``m`` (model_shape.is_moe_layer's rule)."""
    return bool(m.get("n_experts")) and i % m.get("moe_every", 1) == 0 and i not in m.get("moe_dense_layers", [])


def qwen_dense_layers(hf: dict[str, Any], where: str) -> list[int]:
    """Qwen-MoE's dense layers: ``mlp_only_layers`` and every layer i with (i + 1) % decoder_sparse_step != 0
    (transformers' Qwen2MoeDecoderLayer)."""
    n, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise refuse(where, "decoder_sparse_step", step, "a positive step")
    only = [int(i) for i in hf.get("mlp_only_layers") or []]
    return sorted({*(i for i in only if 0 <= i < n), *(i for i in range(n) if (i + 1) % step)})


def router_fields(hf: dict[str, Any], where: str, experts_key: str, default_norm: bool) -> dict[str, Any]:
    """The routed experts of a softmax top-k config.json: count, k, the experts' width, renormalisation, the
    auxiliary loss's coefficient (the family's ``router_aux_loss_coef``, no z-loss), dropless routing."""
    if hf.get(experts_key) is None:
        raise ValueError(f"{where}: {experts_key} is missing (the number of routed experts)")
    return {"n_experts": int(hf[experts_key]), "top_k": int(hf.get("num_experts_per_tok", 2)),
            "moe_d_ff": int(hf["moe_intermediate_size"]), "capacity_factor": None, "moe_every": 1,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", default_norm)),
            "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.001)), "router_z_loss": 0.0}


def router_keys(m: dict[str, Any], experts_key: str) -> dict[str, Any]:
    """The inverse of ``router_fields`` and ``qwen_dense_layers`` (every dense layer listed in mlp_only_layers)."""
    return {experts_key: m["n_experts"], "num_experts_per_tok": m["top_k"], "moe_intermediate_size": expert_width(m),
            "norm_topk_prob": m.get("norm_topk_prob", True), "router_aux_loss_coef": m.get("router_aux_loss", 0.01),
            "decoder_sparse_step": 1, "mlp_only_layers": sorted(m.get("moe_dense_layers", [])),
            "output_router_logits": False}


def expert_width(m: dict[str, Any]) -> int:
    """ModelConfig.expert_ffn_dim of fields ``m``."""
    return int(m.get("moe_d_ff") or m.get("d_ff") or 4 * m["d_model"])


def mlp_recipes(m: dict[str, Any], h: str, o: str, *, block: str = "mlp", router: str = "gate",
                leaves: tuple[tuple[str, str], ...] = LEAVES, shared: str | None = None,
                shared_gate: str | None = None) -> dict[str, Recipe]:
    """The feed-forward recipes of layer ``o`` (``layers.{i}.``) from HF layer ``h``: a sparse layer's router,
    experts, shared expert and its gate (``shared``, ``shared_gate``: their HF names in ``block``), or a dense
    layer's MLP."""
    i = int(o.split(".")[1])
    if not is_moe(m, i):
        return {f"{o}mlp.{ours}.weight": Recipe(f"{h}mlp.{theirs}.weight") for ours, theirs in LEAVES}
    b = f"{h}{block}."
    out = {f"{o}moe.router.weight": Recipe(f"{b}{router}.weight")}
    for e in range(m["n_experts"]):
        out.update({f"{o}moe.experts.{e}.{ours}.weight": Recipe(f"{b}experts.{e}.{theirs}.weight")
                    for ours, theirs in leaves})
    if shared and m.get("n_shared_experts"):
        out.update({f"{o}moe.shared_expert.{ours}.weight": Recipe(f"{b}{shared}.{theirs}.weight")
                    for ours, theirs in LEAVES})
    if shared_gate and m.get("shared_expert_gate"):
        out[f"{o}moe.shared_expert_gate.weight"] = Recipe(f"{b}{shared_gate}.weight")
    return out
