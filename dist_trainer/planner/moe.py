"""The planner's mixture-of-experts terms: what a rank holds under expert parallelism, the dispatch buffers,
the FLOPs a MoE layer costs and the all-to-all volume. Torch-free; read off ``model_moe.py`` and
``parallel/ep/`` (the counts per module are ``model_shape.moe_block_params``).

* Holdings: the MoE block (router, experts, shared expert) is replicated on every TP rank; expert parallelism
  leaves a rank n_experts / ep_size experts, whose model states DDP does not all-reduce and ZeRO-1/2 partition
  over the expert-data-parallel group (dp / ep ranks) instead of dp (DeepSpeed's MoE param groups).
* Dispatch with a capacity: each expert gets ``cfg.expert_capacity(s)`` slots per sequence, so a micro-batch of b
  sequences fills a buffer of E x b x capacity x d_model per MoE layer; the experts run on every slot, empty or
  not, so their FLOPs are slots x MLP, not top_k x MLP. Dropless (``capacity_factor: none``): the b x s x top_k
  rows sorted by expert, top_k x MLP per token. Where the rows land depends on the routing: the planner prices the
  balanced expectation (top_k rows per token on every ep rank's experts) and names the worst case
  (``memory.with_dropless_peak``: every row the ep group can send to one rank's experts).
* All-to-all (parallel/ep/apply.py): the buffer (the rows) goes out and the experts' outputs come back, 2
  exchanges forward and their 2 gradients backward per MoE layer and micro-batch (2 more per recomputed MoE
  layer). Under autocast the rows leave in the residual's dtype (fp32) and the outputs come back in 16 bits. A
  capacity exchange is counted whole; a dropless one is charged the rows of the rank's own tokens (b x s x top_k
  each way, whatever the routing: ``parallel/ep/comms.py``), after one exchange of the E row counts (int64) per
  forward. They sit between the router and the experts and between the experts and the combine: exposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_shape import moe_block_params
from dist_trainer.planner.params import expert_params, mlp_weights


def moe_layer_ids(cfg: ModelConfig, layer_ids: Sequence[int] | None = None) -> list[int]:
    """The MoE layers among ``layer_ids`` (default: the whole model)."""
    if not cfg.n_experts:
        return []
    ids = range(cfg.n_layers) if layer_ids is None else layer_ids
    return [i for i in ids if cfg.is_moe_layer(i)]


@dataclass(frozen=True)
class MoEHoldings:
    """What one rank holds of its MoE layers (every layer counted)."""

    modules: dict[str, int]  # by module row, as rank_params reports them
    replicated: int  # identical on every TP rank (the whole MoE block)
    expert: int  # split by expert parallelism (this rank's experts), reduced over edp


def moe_holdings(cfg: ModelConfig, n_moe_layers: int, ep_size: int = 1) -> MoEHoldings:
    """The ``moe`` modules of ``n_moe_layers`` MoE layers on one rank (attention and norms are the dense rows)."""
    if not n_moe_layers:
        return MoEHoldings({}, 0, 0)
    block = moe_block_params(cfg)
    here = cfg.n_experts // ep_size
    modules = {f"layers.*.moe.{k}": v * n_moe_layers * (here if k.startswith("experts.") else 1)
               for k, v in block.items() if v}
    expert = n_moe_layers * here * expert_params(cfg)
    return MoEHoldings(modules, sum(modules.values()), expert if ep_size > 1 else 0)


def largest_moe_module(cfg: ModelConfig) -> int:
    return max(v for v in moe_block_params(cfg).values())


# ---------------------------------------------------------------- dispatch buffers and traffic


def slots_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Expert rows computed per token: n_experts x capacity / seq_len (top_k x capacity_factor, rounded up);
    top_k dropless."""
    if cfg.dropless:
        return cfg.top_k
    return cfg.n_experts * cfg.expert_capacity(seq_len) / seq_len


def dispatch_elements(cfg: ModelConfig, *, micro_batch: int, seq_len: int) -> int:
    """Elements of one MoE layer's dispatch buffer: E x b x capacity x d_model (the experts' outputs alike);
    dropless, the b x s x top_k rows of d_model."""
    if cfg.dropless:
        return micro_batch * seq_len * cfg.top_k * cfg.d_model
    return cfg.n_experts * micro_batch * cfg.expert_capacity(seq_len) * cfg.d_model


def all_to_all_bytes(cfg: ModelConfig, *, n_moe_layers: int, micro_batch: int, seq_len: int, n_microbatches: int,
                     n_recomputed: int = 0, in_bytes: int = 4, out_bytes: int = 4) -> int:
    """Bytes a rank hands to its ep all-to-alls in one step (``AxisGroup``'s count: the whole buffer per call).

    Per MoE layer and micro-batch: the buffer out and the outputs back in the forward, their gradients in the
    backward (the outputs' gradient in 16 bits under autocast, the inputs' in the residual's dtype), and one more
    forward pair per fully recomputed MoE layer."""
    elems = dispatch_elements(cfg, micro_batch=micro_batch, seq_len=seq_len)
    counts = 8 * cfg.n_experts if cfg.dropless else 0  # the row counts exchanged before the rows, each forward
    per_layer = 2 * elems * (in_bytes + out_bytes) + counts
    recompute = elems * (in_bytes + out_bytes) + counts
    return n_microbatches * (n_moe_layers * per_layer + n_recomputed * recompute)


def moe_flops_per_token(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """(model, hardware) forward matmul FLOPs of a MoE layer's ``moe`` block per token, beyond the attention:
    the router, top_k experts (model) or every slot (hardware: padding is computed), the shared expert (and its
    gate)."""
    mlp = expert_flops_per_token(cfg)
    router = 2.0 * cfg.d_model * (cfg.n_experts + cfg.shared_expert_gate)
    shared = cfg.n_shared_experts * mlp
    return router + cfg.top_k * mlp + shared, router + slots_per_token(cfg, seq_len) * mlp + shared


def dense_mlp_flops_per_token(cfg: ModelConfig) -> float:
    return 2.0 * mlp_weights(cfg)


def expert_flops_per_token(cfg: ModelConfig) -> float:
    """One routed expert's forward matmul FLOPs on one token (moe_d_ff wide)."""
    return 2.0 * mlp_weights(cfg) * cfg.expert_ffn_dim / cfg.ffn_dim


def ep_link_is_intra(*, ep_size: int, tp_size: int, pp_size: int, gpus_per_node: int) -> bool:
    """An ep group is ep consecutive dp ranks: ep x pp x tp consecutive global ranks (parallel/mesh.py)."""
    return ep_size * pp_size * tp_size <= gpus_per_node
