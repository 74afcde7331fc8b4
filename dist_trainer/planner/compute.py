"""The step's compute and pipeline bubble, the two terms of ``cost.estimate_step_time`` that are no axis's.

* Compute: the hardware FLOPs of the slowest pipeline stage at the profile's GEMM throughput for this rank's
  matmul shape (tokens of a micro-batch x features per TP rank; ``HardwareProfile.matmul_flops``). A MoE layer
  costs its router, top_k experts and its shared expert per token in model FLOPs (MFU), and every expert slot,
  padding included, in hardware FLOPs; its block is whole on every TP rank, so its FLOPs are not divided by tp.
  With a calibrated profile, the elementwise passes, the optimizer and the per-op cost are added (constants below).
* Bubble: the schedule's idle fraction (``flops.pipeline_bubble``) stretches the slowest stage's compute. On
  shared cores (a CPU profile from ``calibrate``: more ranks than cores) a stage idle in the bubble lends its
  core to the busy ones, so the step is the longer of the critical path at the unloaded speed and the work over
  the cores (``HardwareProfile.oversubscription``).
"""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import Layout
from dist_trainer.planner.flops import pipeline_bubble, step_flops
from dist_trainer.planner.hardware import HardwareProfile
from dist_trainer.planner.moe import moe_flops_per_token, moe_layer_ids
from dist_trainer.planner.options import TrainingOptions
from dist_trainer.planner.seq2seq import target_length

# The work between the GEMMs, counted on our layer (model.py), per token, forward + backward (backward about twice
# the forward's passes), in elements read or written: norms and residual adds over d_model (split by t only under
# SP); attention layout copies, SDPA's reads and writes and the MLP activation over the TP-split widths; the
# log-softmax and its gradient over the vocabulary (split by t). Priced only with a profile's memory_bw.
PASSES_REPLICATED = 28  # x d_model: 2 norms (2 each) + 2 residual adds (3 each) forward, ~1.8x that backward
PASSES_SPLIT = 36  # x d_model / t: q/k/v/o layout copies and SDPA I/O (12 forward, 24 backward)
PASSES_MLP = 5  # x ffn / t: the activation (2 forward, 3 backward)
PASSES_LOSS = 5  # x vocab / t: log-softmax (2 forward), its gradient (3 backward)
# The math attention kernel's s x s work per token, x heads / t x keys: scale + mask + softmax (read, write) and
# dropout (read, write, mask) forward, their gradients backward (read 2, write 1 each): 2 + 3 + 6, in the
# activation dtype (Megatron's fused scale-mask-softmax and dropout; a flash kernel keeps all of it on chip)
PASSES_SCORES = 11
# Eager PyTorch (``train.compile`` off, the trainer's default; ``TrainingOptions.fused_elementwise`` False): each
# elementwise op is its own kernel reading and writing whole tensors, so the passes above (a fused layer's) are
# too few. Counted on our Llama-class layer (fp32 RMSNorm and RoPE, SwiGLU, grouped KV heads, flash SDPA): every
# non-matmul op's input and output bytes in one forward and backward (a dispatch-mode count, fitted over nine
# shapes that vary each width, residuals under 0.3%; ``tests/test_planner_eager.py`` counts again at another
# shape), by the activations' kind: a 16-bit model, fp32 weights under autocast, fp32. (forward, backward) bytes
# per token and layer, per element of: d_model (norms, residual adds: replicated), the query width, the key/value
# width and the FFN width (each split by t), and the query width again when key/value heads are grouped (the
# repeat to the query heads and its gradient's sum). The forward's share (about a third) is what recomputation
# runs again.
EAGER_LAYER = {"16bit": ((92.5, 246), (60.5, 79), (48, 82), (10, 18), (8, 12.5)),
               "amp": ((107, 294.5), (61, 79.5), (48, 82), (10.5, 18.5), (7.5, 12.5)),
               "fp32": ((81, 252), (61, 78), (36, 84), (20.5, 36.5), (15.5, 25))}
# the loss: (forward, backward) bytes per vocabulary element / t per token (logits to fp32, log-softmax, NLL)
EAGER_LOSS = {"16bit": (18, 26), "amp": (18, 26), "fp32": (12, 20)}
# per micro-batch, (forward, backward) bytes per weight element: the embedding and head tables (vocab x d_model / t:
# the embedding's dense gradient; under autocast the head's copy to 16 bits and its gradient back) and under
# autocast each layer's linear weights (fp32 read, 16-bit written; the gradient cast back)
EAGER_TABLES = {"16bit": (2, 2), "amp": (10, 10), "fp32": (4, 4)}
EAGER_AMP_CAST = (6, 6)
OPS_PER_LAYER = 55  # ops (kernels) of one layer's forward and backward on one micro-batch
OPS_PER_MICRO = 15  # embedding, final norm, head and loss, forward and backward
ADAM_BYTES = 28  # fp32 AdamW reads p, g, m, v and writes p, m, v
ADAM_OPS = 10  # ops per parameter tensor of torch's single-tensor AdamW (foreach=False); DeepSpeed's flat groups: 2


def step_model_flops(cfg: ModelConfig, layout: Layout, *, seq_len: int, options: TrainingOptions
                     ) -> tuple[float, float]:
    """(model, hardware) FLOPs of one step of ``layout`` (its batch and recomputation)."""
    return step_flops(cfg, seq_len=seq_len, global_batch=layout.global_batch_size,
                      recompute=layout.activation_checkpointing, checkpoint_every=layout.checkpoint_every,
                      fused_attention=options.attention_kernel == "flash",
                      target_len=target_length(seq_len, options.target_len, options.source_mask)
                      if cfg.n_decoder_layers else None)


def compute_seconds(cfg: ModelConfig, layout: Layout, *, seq_len: int, hardware: HardwareProfile,
                    gpus_per_node: int, options: TrainingOptions, hw_flops: float, most_layers: int, tokens: int,
                    trainable: int) -> float:
    """Seconds of the slowest stage's compute in one step (module docstring)."""
    n, t, p = layout.world_size, layout.tp_size, layout.pp_size
    imbalance = most_layers * p / (cfg.n_layers + cfg.n_decoder_layers)  # the slowest stage sets the pace
    compute = hw_flops / n * imbalance / hardware.matmul_flops(options.precision, tokens, cfg.d_model / t)
    whole = t * layout.sample_split  # the ranks that compute each MoE block whole (TP's, and a split sample's)
    if whole > 1 and cfg.n_experts:  # the MoE blocks are whole on each of them: that many times their share
        _, moe_hw = moe_flops_per_token(cfg, seq_len)
        block = 3.0 * len(moe_layer_ids(cfg)) * moe_hw * layout.global_batch_size * seq_len
        compute += block * (whole - 1) / n * imbalance / hardware.matmul_flops(options.precision, tokens,
                                                                               cfg.d_model)
    compute += memory_and_overhead(cfg, layout, options, hardware, most_layers, tokens, trainable, seq_len)
    return compute / hardware.rank_speed(min(gpus_per_node, n))  # a CPU profile measured with other busy ranks


def bubble_seconds(layout: Layout, compute: float, hardware: HardwareProfile, gpus_per_node: int) -> float:
    """The schedule's critical path beyond ``compute``; on shared cores (oversubscription f > 1) a stage idle in
    the bubble lends its core, the busy ones run up to f times faster, and the step is never shorter than the work
    over the cores."""
    frac = pipeline_bubble(layout.pp_size, layout.n_microbatches, layout.pp_virtual_stages, layout.pp_schedule)
    ranks_per_node = min(gpus_per_node, layout.world_size)
    return max(0.0, compute / hardware.oversubscription(ranks_per_node) / (1 - frac) - compute)


def memory_and_overhead(cfg: ModelConfig, layout: Layout, options: TrainingOptions, hardware: HardwareProfile,
                        layers: int, tokens: int, trainable: int, seq_len: int) -> float:
    """Seconds of the elementwise passes, the optimizer and the per-op cost of this rank's step (constants above)
    at the profile's memory bandwidth (``memory_bw``: the HBM data sheet, or dist-trainer calibrate's measurement;
    None: 0, ``efficiency`` standing for them) and its per-op cost (``op_overhead``, calibrated profiles only: a
    GPU's launches are asynchronous). The math kernel's s x s passes are priced here too; a flash kernel has none.
    Every micro-batch crosses the last stage, so the loss's passes are on the critical path whatever the stage. The
    optimizer updates the ``trainable`` parameters only."""
    if hardware.memory_bw is None:
        return 0.0
    t, m = layout.tp_size, layout.n_microbatches
    act = 4 if options.precision == "fp32" else 2
    replicated = cfg.d_model / t if layout.sequence_parallel else cfg.d_model
    scores = PASSES_SCORES * cfg.n_heads / t * seq_len * act if options.attention_kernel == "math" else 0.0
    # a recomputed forward: its passes again; op-level recomputes every elementwise pass
    recomputed = {"full": 1.0, "op": 1.0, "every_k": 1.0 / layout.checkpoint_every, "selective": 0.2}.get(
        layout.activation_checkpointing, 0.0)
    if options.fused_elementwise:  # the forward about a third of the passes
        per_token = layers * ((PASSES_REPLICATED * replicated + PASSES_SPLIT * cfg.d_model / t
                               + PASSES_MLP * cfg.ffn_dim / t) * act + scores) * (1 + recomputed / 3)
        passes = m * tokens * (per_token + PASSES_LOSS * cfg.vocab_size / t * 4)
    else:
        passes = m * (tokens * eager_bytes_per_token(cfg, options.precision, t, replicated, layers, recomputed,
                                                     scores)
                      + eager_weight_bytes(cfg, options.precision, t, layers, recomputed))
    optimizer_bytes = ADAM_BYTES * trainable / (layout.replicas if layout.zero_stage else 1)
    tensors = 16 * layers + 4  # a rank's parameter tensors (a GPT layer's 16 with biases; embeddings, norms)
    optimizer_ops = ADAM_OPS * (tensors if layout.zero_stage == 0 else 2)
    ops = m * (OPS_PER_LAYER * layers + OPS_PER_MICRO) + optimizer_ops
    return (passes + optimizer_bytes) / hardware.memory_bw + ops * (hardware.op_overhead or 0.0)


def _kind(precision: str) -> str:
    return "fp32" if precision == "fp32" else "amp" if precision.startswith("amp") else "16bit"


def eager_bytes_per_token(cfg: ModelConfig, precision: str, t: int, replicated: float, layers: int,
                          recomputed: float, scores: float = 0.0) -> float:
    """Bytes the eager elementwise kernels of ``layers`` layers and the loss move per token of a micro-batch on a rank
    (``EAGER_LAYER``, ``EAGER_LOSS``): ``replicated`` d_model's elements (d_model / t under SP), the rest split by
    t; ``recomputed`` of the forward's run again; ``scores``: the math kernel's s x s bytes per token and layer."""
    q, kv = cfg.q_dim / t, cfg.kv_heads * cfg.head_dim / t
    widths = (replicated, q, kv, cfg.ffn_dim / t, q if cfg.kv_heads < cfg.n_heads else 0.0)
    layer = sum(w * (fwd * (1 + recomputed) + bwd) for w, (fwd, bwd) in zip(widths, EAGER_LAYER[_kind(precision)]))
    return layers * (layer + scores * (1 + recomputed / 3)) + sum(EAGER_LOSS[_kind(precision)]) * cfg.vocab_size / t


def eager_weight_bytes(cfg: ModelConfig, precision: str, t: int, layers: int, recomputed: float,
                       tables: bool = True) -> float:
    """Bytes of the eager step's passes over weights in one micro-batch on a rank (``EAGER_TABLES``,
    ``EAGER_AMP_CAST``): the vocabulary tables' (``tables``: this rank holds them) and, under autocast, each of
    ``layers`` layers' linear weights (its share under TP) cast to 16 bits in every forward, recomputed ones
    included, and their gradients cast back."""
    kind = _kind(precision)
    out = sum(EAGER_TABLES[kind]) * cfg.vocab_size * cfg.d_model / t if tables else 0.0
    if kind == "amp":
        weights = cfg.d_model * (2 * cfg.q_dim + 2 * cfg.kv_heads * cfg.head_dim
                                 + (3 if cfg.gated else 2) * cfg.ffn_dim)
        fwd, bwd = EAGER_AMP_CAST
        out += layers * weights / t * (fwd * (1 + recomputed) + bwd)
    return out
