"""FLOPs, communication volume, pipeline bubble and an estimated step time for one layout.

* FLOPs: 2 per matmul weight per token forward, 4 backward (6 Psi per token, Kaplan et al. 2020), plus the
  attention scores and weighted sum, 2 * 2 * s * h per layer and token forward, counted in full as Megatron
  does (Narayanan et al. 2021, eq. 3; Korthikanti et al. 2022, appendix A: 72 B s L h^2 (1 + s/(6h) +
  V/(12 h L)) for a GPT layer with d_ff = 4h); recomputation adds the recomputed forwards.
* Communication per rank and step: TP all-reduces 2 forward + 2 backward per layer of b*s*h elements
  (Shoeybi et al. 2019; with SP each becomes an all-gather + reduce-scatter pair of the same volume,
  Korthikanti et al. 2022), a ring all-reduce moving 2(n-1)/n of the buffer; PP sends the activation forward
  and its gradient backward per micro-batch; DP all-reduces the gradients; ZeRO 1-2 reduce-scatter gradients
  and all-gather parameters (2 Psi), ZeRO-3 gathers the parameters again for backward (3 Psi; ZeRO section 7).
* Bubble: (p - 1)/(m + p - 1) of the step for GPipe/1F1B, (p - 1)/v in units of one micro-batch for
  interleaved 1F1B (Narayanan et al. 2021, section 2.2), a third of 1F1B's for zero bubble (ZB-H1,
  Qi et al. 2023, section 3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dist_trainer.config import ModelConfig
from dist_trainer.planner.hardware import HardwareProfile
from dist_trainer.planner.memory import DEFAULT_OPTIONS, Layout, TrainingOptions
from dist_trainer.planner.params import matmul_params
from dist_trainer.planner.rank_params import rank_params

DP_OVERLAP = 0.8  # share of the backward that bucketed gradient communication can hide behind (assumption)


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """(matmul, attention) forward FLOPs of one layer per token."""
    h, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    mats = 3 if cfg.activation == "swiglu" else 2
    weights = 2 * h * h + 2 * h * kv + mats * h * cfg.ffn_dim
    return 2.0 * weights, 4.0 * seq_len * h


def step_flops(cfg: ModelConfig, *, seq_len: int, global_batch: int, recompute: str = "none",
               checkpoint_every: int = 1) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one optimizer step; they differ by the recomputed forwards."""
    tokens = global_batch * seq_len
    mm, attn = layer_forward_flops_per_token(cfg, seq_len)
    forward = cfg.n_layers * (mm + attn) + 2.0 * matmul_params_head(cfg)
    model = 3.0 * forward * tokens
    if recompute == "full":
        extra = cfg.n_layers * (mm + attn)
    elif recompute == "every_k":
        extra = len(range(0, cfg.n_layers, checkpoint_every)) * (mm + attn)
    elif recompute == "selective":
        # only the attention core runs again: QK^T and AV, 4 s h per token and layer (Korthikanti et al. 2022,
        # appendix A: "2Bs^2h + 2Bs^2h"; their eq. 8 adds 12 B L s^2 h, three times this; see docs/planner.md)
        extra = cfg.n_layers * attn
    else:
        extra = 0.0
    return model, model + extra * tokens


def matmul_params_head(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.d_model


def six_psi_flops(cfg: ModelConfig, tokens: int) -> float:
    """The 6 x params x tokens rule on matmul weights alone (no attention), for comparison."""
    return 6.0 * matmul_params(cfg) * tokens


def megatron_model_flops(cfg: ModelConfig, *, seq_len: int, global_batch: int) -> float:
    """Korthikanti et al. 2022, appendix A: 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) (GPT, d_ff = 4h, MHA)."""
    B, s, L, h, V = global_batch, seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def pipeline_bubble(pp_size: int, n_microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle fraction of the step: (p - 1)/(m + p - 1), with p - 1 divided by v (interleaved) or 3 (ZB-H1)."""
    if pp_size == 1:
        return 0.0
    idle = (pp_size - 1) / (virtual_stages if schedule == "interleaved_1f1b" else 1)
    if schedule == "zero_bubble":
        idle /= 3.0
    return idle / (n_microbatches + idle)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by component, and what it means for throughput."""

    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float  # exposed part (after overlap with backward)
    offload: float
    total: float
    model_flops: float
    mfu: float
    comm_bytes: dict[str, float]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def comm_bytes_per_rank(cfg: ModelConfig, layout: Layout, *, seq_len: int, options: TrainingOptions,
                        n_params_rank: int, n_trainable_rank: int | None = None) -> dict[str, float]:
    """Bytes each rank sends per step, by regime (ring algorithms). Gradients (and ZeRO-1/2's updated partitions)
    exist for the ``n_trainable_rank`` trainable parameters only (default: all); ZeRO-3 gathers every one."""
    t, p, d, m = layout.tp_size, layout.pp_size, layout.dp_size, layout.n_microbatches
    act = 4 if options.precision == "fp32" else 2
    bsh = layout.micro_batch_size * seq_len * cfg.d_model * act
    layers = cfg.n_layers / p
    out: dict[str, float] = {}
    if t > 1:
        # 2 fwd + 2 bwd all-reduces per layer (or AG/RS pairs of equal volume with SP); +2 per recomputed layer
        # (selective recomputation reruns no linear layer: no collective)
        per_layer = 4 + (2 if layout.activation_checkpointing == "full" else 0)
        out["tp"] = per_layer * layers * m * bsh * 2 * (t - 1) / t
    if p > 1:
        shard = t if layout.sequence_parallel else 1
        out["pp"] = 2 * m * layout.pp_virtual_stages * bsh / shard
    if d > 1:
        frac = (d - 1) / d
        trainable = n_params_rank if n_trainable_rank is None else n_trainable_rank
        grads = trainable * options.grad_bytes
        if layout.zero_stage == 0:
            out["dp"] = 2 * frac * grads
        else:  # reduce-scatter the gradients; all-gather the updated partitions (stage 3: every parameter, for use)
            out["dp"] = frac * (grads + (n_params_rank if layout.zero_stage == 3 else trainable) * options.param_bytes)
            if layout.zero_stage == 3:
                out["zero3_gather"] = frac * n_params_rank * options.param_bytes
    return out


def gemm_efficiency(rows: int, cols: float) -> float:
    """Heuristic: small matmuls reach less of peak; saturates for rows (tokens) and cols (h/t) >> 64."""
    return rows / (rows + 64) * cols / (cols + 64)


def estimate_step_time(cfg: ModelConfig, layout: Layout, *, seq_len: int, hardware: HardwareProfile,
                       gpus_per_node: int, options: TrainingOptions = DEFAULT_OPTIONS,
                       n_params_rank: int | None = None, n_trainable_rank: int | None = None) -> StepTime:
    """Compute at the profile's achievable efficiency, stretched by the bubble, plus exposed communication."""
    n = layout.world_size
    model_f, hw_f = step_flops(cfg, seq_len=seq_len, global_batch=layout.global_batch_size,
                               recompute=layout.activation_checkpointing, checkpoint_every=layout.checkpoint_every)
    peak = hardware.peak_flops(options.precision)
    eff = hardware.efficiency * gemm_efficiency(layout.micro_batch_size * seq_len, cfg.d_model / layout.tp_size)
    compute = hw_f / n / (peak * eff)
    bubble_frac = pipeline_bubble(layout.pp_size, layout.n_microbatches, layout.pp_virtual_stages, layout.pp_schedule)
    bubble = compute * bubble_frac / (1 - bubble_frac)
    n_rank = n_params_rank if n_params_rank is not None else rank_params(
        cfg, tp_size=layout.tp_size, pp_size=layout.pp_size, pp_rank=0, stage_layers=layout.pp_stage_layers,
        virtual_stages=layout.pp_virtual_stages, balance=layout.pp_balance).total
    comm = comm_bytes_per_rank(cfg, layout, seq_len=seq_len, options=options, n_params_rank=n_rank,
                               n_trainable_rank=n_trainable_rank)
    intra = hardware.intra_node_bw
    tp_time = comm.get("tp", 0.0) / intra
    pp_bw = intra if layout.tp_size * layout.pp_size <= gpus_per_node else hardware.inter_node_bw
    pp_time = comm.get("pp", 0.0) / pp_bw
    dp_bw = intra if n <= gpus_per_node else hardware.inter_node_bw
    dp_raw = (comm.get("dp", 0.0) + comm.get("zero3_gather", 0.0)) / dp_bw
    backward = compute * 2.0 / 3.0
    dp_time = max(0.0, dp_raw - DP_OVERLAP * backward)
    offload = 0.0
    if layout.zero_offload:
        shard = (n_rank if n_trainable_rank is None else n_trainable_rank) / layout.dp_size  # the optimizer's part
        transfer = shard * (4 + options.param_bytes) / hardware.pcie_bw  # fp32 grads down, 16-bit params up
        offload = transfer + shard * min(gpus_per_node, n) / hardware.host_adam_params_per_s
    total = compute + bubble + tp_time + pp_time + dp_time + offload
    mfu = model_f / (total * n * peak)
    return StepTime(compute=compute, bubble=bubble, tp_comm=tp_time, pp_comm=pp_time, dp_comm=dp_time,
                    offload=offload, total=total, model_flops=model_f, mfu=mfu, comm_bytes=comm)
