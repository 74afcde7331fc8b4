"""The optimizer's terms of a plan, read from its entry (``optim_entries.py``): the state bytes per parameter it
takes and its fallback's, and for an optimizer of whole matrices (Muon, ``optim_muon.py``) the Newton-Schulz FLOPs
and the tp gather/scatter of the matrices TP splits, in the step time. Torch-free.

The matrices are listed by the model's parameter names and full shapes (the entry's ``takes`` decides, as it does
for the trainer's groups). Each TP-split matrix is orthogonalised by one owner (round robin over tp): per rank a
1/tp share of their FLOPs, and for each one this rank's slice handed to the owner and its slice of the update handed
back (a gather and a scatter, counted on the tp axis as ``AxisGroup`` counts them). Under DeepSpeed's ZeRO-1/2/3 every
matrix has one owner among the dp replicas: a 1/dp share of the FLOPs, and a reduce and a broadcast of the whole
matrix per matrix (the same at every stage: only where each rank's fragment lies in its flat partition differs), and
its momentum partitioned over dp with DeepSpeed's fp32 master (``planner/memory.py`` divides the saving by dp).
NS5 of an A x B matrix (A <= B) is 5 iterations of 3 matmuls: X X^T (2A^2B), its square (2A^3), times X (2A^2B).
"""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.facts.finetune import module_training
from dist_trainer.facts.model_shape import kv_sharded
from dist_trainer.layout_rules import Layout
from dist_trainer.optim_entries import split_bytes
from dist_trainer.planner.axes.base import AxisTime, StepContext, ring_time
from dist_trainer.planner.options import TrainingOptions

NS_STEPS = 5  # optim_muon.NS_STEPS (torch-side)
STATE_DTYPE_BYTES = 4  # the momentum and the gathered slices are fp32


def _layer_matrices(cfg: ModelConfig, layer: int, tp_size: int, ep_size: int) -> list[tuple[str, int, int, bool]]:
    """(name, rows, cols, split by tp) of the 2-D projection weights of global layer ``layer``."""
    h, q, kv = cfg.d_model, cfg.q_dim, cfg.kv_heads * cfg.head_dim
    kv_split = kv_sharded(cfg, tp_size)
    stack, i = ("layers", layer) if layer < cfg.n_layers else ("dec_layers", layer - cfg.n_layers)
    prefix = f"{stack}.{i}"
    attns = ["attn"] + (["cross_attn"] if stack == "dec_layers" else [])
    out = []
    for attn in attns:
        out += [(f"{prefix}.{attn}.q_proj.weight", q, h, True), (f"{prefix}.{attn}.k_proj.weight", kv, h, kv_split),
                (f"{prefix}.{attn}.v_proj.weight", kv, h, kv_split), (f"{prefix}.{attn}.o_proj.weight", h, q, True)]

    def mlp(name: str, width: int, split: bool) -> list[tuple[str, int, int, bool]]:
        leaves = [("up_proj", width, h), ("down_proj", h, width)] + ([("gate_proj", width, h)] if cfg.gated else [])
        return [(f"{name}.{leaf}.weight", r, c, split) for leaf, r, c in leaves]

    if layer < cfg.n_layers and cfg.is_moe_layer(layer):  # the MoE block is whole on every TP rank
        for e in range(cfg.n_experts // ep_size):  # this ep rank's experts (the same count on each)
            out += mlp(f"{prefix}.moe.experts.{e}", cfg.ffn_dim, False)
        if cfg.n_shared_experts:
            out += mlp(f"{prefix}.moe.shared_expert", cfg.n_shared_experts * cfg.ffn_dim, False)
    else:
        out += mlp(f"{prefix}.mlp", cfg.ffn_dim, True)
    return out


def taken_matrices(cfg: ModelConfig, layout: Layout, options: TrainingOptions,
                   pp_rank: int) -> list[tuple[int, int, bool]]:
    """(rows, cols, split by tp) of every matrix the optimizer's entry takes on pipeline rank ``pp_rank`` (full
    shapes): of those that train, as the trainer's groups hold only trainable parameters (LoRA's frozen base and
    ``options.freeze``'s modules get no state and no update; ``facts/finetune.py`` decides, as for the trainer).
    Under ep > 1 the experts are ep rank 0's (local index e is global index e there)."""
    entry = options.entry
    if entry.fallback is None:
        return []  # it takes every parameter: no split of the bytes
    trains = module_training(cfg, options.freeze) if cfg.lora_rank or options.freeze else None
    out = []
    for layer in layout.rank_layer_ids(cfg, pp_rank):
        for name, rows, cols, split in _layer_matrices(cfg, layer, layout.tp_size, layout.ep_size):
            if entry.takes(name, (rows, cols)) and (trains is None or trains[name.removesuffix(".weight")][0]):
                out.append((rows, cols, split and layout.tp_size > 1))
    return out


def taken_params(cfg: ModelConfig, layout: Layout, options: TrainingOptions, pp_rank: int) -> int:
    """Of this rank's parameters, how many the entry itself steps apart from a fallback (0 for an entry without one:
    it steps them all at the same bytes)."""
    return sum(r * c // (layout.tp_size if split else 1)
               for r, c, split in taken_matrices(cfg, layout, options, pp_rank))


def state_saving(cfg: ModelConfig, layout: Layout, options: TrainingOptions, pp_rank: int) -> int:
    """Bytes the entry's own states save against its fallback's on the parameters it takes (``options``' K counts
    the fallback's bytes for every parameter of an entry with a fallback)."""
    own, fallback = split_bytes(options.entry, options.optim_state_dtype)
    return (fallback - own) * taken_params(cfg, layout, options, pp_rank)


def ns_flops(rows: int, cols: int) -> int:
    a, b = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * a * a * b + 2 * a ** 3)


def rank_ns_flops(cfg: ModelConfig, layout: Layout, options: TrainingOptions, pp_rank: int) -> float:
    """The Newton-Schulz FLOPs of one step on a rank: its whole matrices, and 1/tp of the TP-split ones."""
    return sum(ns_flops(r, c) / (layout.tp_size if split else 1) for r, c, split in
               taken_matrices(cfg, layout, options, pp_rank))


def optimizer_time(ctx: StepContext) -> dict[str, AxisTime]:
    """The ``optimizer`` term of a step (slowest pipeline rank): Newton-Schulz matmuls in fp32 at the profile's
    GEMM rate for their shapes, and the tp gather and scatter of each split matrix (after the backward: exposed)."""
    cfg, layout, options, hardware = ctx.cfg, ctx.layout, ctx.options, ctx.hardware
    if options.entry.fallback is None:
        return {}
    # under ZeRO (dp alone, optim_entries' zero_dp_only) every matrix is rebuilt on one of the dp replicas: a
    # reduce of the whole matrix to its owner and a broadcast of its update, each the whole fp32 matrix
    zero, n = layout.zero_stage > 0, layout.replicas
    t = layout.tp_size
    worst = (0.0, 0.0)
    for pp_rank in range(layout.pp_size):
        seconds = sent = 0.0
        for r, c, split in taken_matrices(cfg, layout, options, pp_rank):
            share = n if zero else t if split else 1
            seconds += ns_flops(r, c) / share / hardware.matmul_flops("fp32", min(r, c), max(r, c))
            whole = STATE_DTYPE_BYTES * r * c
            if zero:
                seconds += 2 * ring_time("all_gather", whole, n, *ctx.link(layout.world_size))
                sent += 2 * whole
            elif split:
                seconds += 2 * ring_time("all_gather", whole, t, *ctx.intra)  # the gather, then the scatter
                sent += 2 * whole / t
        worst = max(worst, (seconds, sent))
    moves = "dp reduce/broadcast" if zero else "tp gather/scatter"
    return {"optimizer": AxisTime(worst[1], worst[0], worst[0],
                                  f"Newton-Schulz (5 x 3 matmuls per matrix) and {moves}: all exposed")}


def gather_scatter_bytes(cfg: ModelConfig, layout: Layout, options: TrainingOptions, pp_rank: int) -> int:
    """Bytes a rank hands to the tp axis in one step for the split matrices: its fp32 slice of each, gathered, and
    as many received in the scatter (each counted as ``AxisGroup.gather`` / ``scatter`` count them)."""
    t = layout.tp_size
    return sum(2 * STATE_DTYPE_BYTES * r * c // t for r, c, split in taken_matrices(cfg, layout, options, pp_rank)
               if split)
