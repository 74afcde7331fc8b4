"""Activation bytes per micro-batch, derived from the tensors dist_trainer.model really saves for backward.

Korthikanti et al. 2022 (arXiv 2205.05198, section 4) count Megatron's layer: s*b*h*(34 + 5*a*s/h) bytes
with 16-bit activations, 1-byte dropout masks and an attention that stores its s x s probabilities.
Our layer differs in ways that change the figure, so each saved tensor is listed here, per token of the
micro-batch, with its dtype (checked against a saved-tensor-hook measurement in tests/test_planner_activations.py):

* norms run in fp32 (model.py casts to fp32), so each norm keeps a 4-byte copy of its input (LayerNorm: + mean
  and rstd, RMSNorm: + rsqrt and the normalised fp32 product), and the following linear keeps its own
  16-bit (or fp32) input;
* ``F.scaled_dot_product_attention`` with a flash kernel (CUDA flash/efficient, and the CPU flash kernel
  PyTorch picks when dropout is off) saves q, k, v, the output and an fp32 log-sum-exp of b*a*s floats:
  no s x s matrix. The math kernel (CPU with attention dropout) saves the scaled q, k^T, v, the probabilities,
  and with dropout a mask and the dropped probabilities: the 5as/h family;
* grouped kv heads are repeated before SDPA, so SDPA saves full-width k and v whatever n_kv_heads is;
* ReLU saves its output (which is also the down projection's input); GELU saves its input; SwiGLU saves gate,
  silu(gate), up and the product;
* dropout masks exist only when model.dropout > 0: 1 byte (bool) on CUDA, the activation dtype on CPU;
* the loss keeps the fp32 log-softmax (4 bytes x V per token) and the int64 targets; the embedding keeps the
  int64 token ids. When backward starts the loss's gradients join them (8V bytes per token in one process):
  a transient of the last stage, reported apart from the saved tensors;
* selective recomputation (Korthikanti et al. 2022, section 4.2) runs each layer's attention core (RoPE, the
  GQA repeat, SDPA) under torch.utils.checkpoint: the layer keeps the q/k/v projections' outputs instead of the
  core's tensors, whatever the kernel;
* a mixture-of-experts layer (``model_moe.py``) keeps, instead of the MLP's tensors, the router's fp32
  probabilities, log-sum-exp and top-k choices, the experts' input buffer (E x capacity slots per sequence:
  the dispatch buffer, or what the all-to-all brought under expert parallelism) and each expert's MLP tensors
  on every slot, and the gathered outputs the gates multiply; the block is whole on every TP rank.

Precision modes: ``fp32``; ``amp_bf16``/``amp_fp16`` (fp32 parameters under torch.autocast, as
``train.precision=bf16``: the residual stream stays fp32, every linear keeps a 16-bit copy of its input and
autocast keeps 16-bit copies of the weights for the backward); ``bf16``/``fp16`` (a 16-bit model, as DeepSpeed
and Megatron run it: 16-bit residual stream).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from dist_trainer.config import ModelConfig
from dist_trainer.planner.params import kv_sharded, padded_vocab

PRECISIONS = ("fp32", "bf16", "fp16", "amp_bf16", "amp_fp16")
ATTENTION_KERNELS = ("flash", "math")
RECOMPUTE = ("none", "selective", "every_k", "full")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class SavedTensor:
    """One tensor kept for backward: elements per token of the micro-batch (on this rank) and their size."""

    name: str
    per_token: float
    nbytes: int  # bytes per element

    @property
    def bytes_per_token(self) -> float:
        return self.per_token * self.nbytes


@dataclass(frozen=True)
class ActivationSpec:
    """What decides the saved tensors: the rank's TP shard, SP, precision, kernel, device (for masks)."""

    seq_len: int
    tp_size: int = 1
    sequence_parallel: bool = False
    precision: str = "fp32"
    attention_kernel: str = "flash"
    device: str = "cuda"  # dropout masks are bool on CUDA, the activation dtype on CPU
    # Our TP regime all-gathers the SP shard in an autograd Function before F.linear, so the linear keeps the
    # gathered input (parallel/tp/layers.py); Megatron keeps the shard and re-gathers in backward (False).
    sp_saves_gathered_input: bool = True
    ep_size: int = 1  # expert parallelism: the experts whose weights autocast copies (the activations do not change)

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r} is not one of flash, math")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r} must be cuda or cpu")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("sequence_parallel needs tp_size > 1")
        if self.seq_len < 1 or self.tp_size < 1:
            raise ValueError(f"seq_len={self.seq_len} and tp_size={self.tp_size} must be >= 1")

    @property
    def act(self) -> int:
        """Bytes of a linear's saved input and of attention/MLP intermediates."""
        return 4 if self.precision == "fp32" else 2

    @property
    def residual(self) -> int:
        """Bytes of the residual stream: fp32 unless the model itself is 16-bit."""
        return 2 if self.precision in ("bf16", "fp16") else 4

    @property
    def mask(self) -> int:
        return 1 if self.device == "cuda" else self.act

    @property
    def rep(self) -> float:
        """Share of a TP-replicated tensor one rank keeps: 1, or 1/t when SP splits the sequence."""
        return 1 / self.tp_size if self.sequence_parallel else 1.0

    @property
    def lin_in(self) -> float:
        """Share of a column-parallel linear's input kept: Megatron keeps the SP shard and re-gathers."""
        return 1.0 if self.sp_saves_gathered_input else self.rep


def _norm(cfg: ModelConfig, spec: ActivationSpec, name: str) -> list[SavedTensor]:
    # model.py computes both norms in fp32: the saved input is an fp32 tensor in every precision.
    out = [SavedTensor(f"{name}.input", cfg.d_model * spec.rep, 4)]
    if cfg.norm == "layernorm":
        out.append(SavedTensor(f"{name}.mean_rstd", 2 * spec.rep, 4))
    else:  # RMSNorm: rsqrt(mean(x^2)) and x * rsqrt, both fp32 (the weight multiply needs the product)
        out += [SavedTensor(f"{name}.rsqrt", spec.rep, 4), SavedTensor(f"{name}.normalised", cfg.d_model * spec.rep, 4)]
    return out


def attention_core_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """What ``Attention.core`` (RoPE, GQA repeat, SDPA) saves when it is not recomputed; selective
    recomputation keeps none of it and rebuilds it, one layer at a time, in backward."""
    spec.validate()
    t, h, a, s = spec.tp_size, cfg.d_model, cfg.n_heads, spec.seq_len
    if spec.attention_kernel == "flash":
        out = [SavedTensor(f"attn.{n}", h / t, spec.act) for n in ("q", "k", "v")]
        return out + [SavedTensor("attn.logsumexp", a / t, 4), SavedTensor("attn.out", h / t, spec.act)]
    # math kernel: the scaled q, k^T and v it multiplies, computed in fp32 on CPU for 16-bit inputs
    inner = 4 if spec.device == "cpu" else spec.act
    out = [SavedTensor(f"attn.{n}", h / t, inner) for n in ("q_scaled", "k_t", "v")]
    out.append(SavedTensor("attn.probs", a * s / t, inner))  # the s x s probabilities per head
    if cfg.dropout > 0:
        mask = 1 if spec.device == "cuda" else inner
        out += [SavedTensor("attn.dropout_mask", a * s / t, mask), SavedTensor("attn.dropped_probs", a * s / t, inner)]
    return out


def _attention(cfg: ModelConfig, spec: ActivationSpec, selective: bool) -> list[SavedTensor]:
    h, t = cfg.d_model, spec.tp_size
    if selective:
        # torch.utils.checkpoint keeps the core's inputs: the q/k/v projections' outputs (k and v before the GQA
        # repeat; under TP with replicated kv heads parallel/tp/layers.ReplicatedKVLinear already returns one kv
        # head per local query head), and o_proj keeps the core's output, whatever the kernel.
        kv = cfg.kv_heads * cfg.head_dim
        kv_local = kv if t == 1 else (kv / t if kv_sharded(cfg, t) else h / t)
        return [SavedTensor("attn.q_proj_out", h / t, spec.act), SavedTensor("attn.k_proj_out", kv_local, spec.act),
                SavedTensor("attn.v_proj_out", kv_local, spec.act), SavedTensor("o_proj.input", h / t, spec.act)]
    out = attention_core_saved_tensors(cfg, spec)
    if spec.attention_kernel == "math":
        out.append(SavedTensor("attn.out", h / t, spec.act))  # the transpose-reshape copy o_proj keeps
    elif cfg.pos_embedding == "rope":
        # rotated q is contiguous (B, H, T, D); the kernel's output follows q's layout, so the
        # transpose-reshape before o_proj copies it (measured on the CPU flash kernel)
        out.append(SavedTensor("o_proj.input", h / t, spec.act))
    return out


def _mlp(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    f = cfg.ffn_dim / spec.tp_size
    if cfg.activation == "relu":  # relu saves its output, which is also down_proj's input
        return [SavedTensor("mlp.relu_out", f, spec.act)]
    if cfg.activation == "swiglu":
        return [SavedTensor(f"mlp.{n}", f, spec.act) for n in ("gate_out", "silu_out", "up_out", "product")]
    return [SavedTensor("mlp.up_out", f, spec.act), SavedTensor("mlp.gelu_out", f, spec.act)]


def moe_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """What a MoE layer's ``moe`` block keeps for backward, per token of the micro-batch (module docstring)."""
    E, k, d = cfg.n_experts, cfg.top_k, cfg.d_model
    slots = E * cfg.expert_capacity(spec.seq_len) / spec.seq_len  # expert slots per token, padding included
    amp = spec.precision.startswith("amp")
    whole = dataclasses.replace(spec, tp_size=1, sequence_parallel=False)  # replicated on the TP ranks
    copies = 2 if amp and cfg.activation == "swiglu" else 1  # autocast casts the input for up and gate apart
    out = [SavedTensor("moe.router_probs", 2 * E, 4),  # softmax for the routing and for the aux loss
           SavedTensor("moe.router_logits", E, 4), SavedTensor("moe.logsumexp", 2, 4),  # z-loss (and its square)
           SavedTensor("moe.top_k", k, 8), SavedTensor("moe.top_p", k + 1, 4), SavedTensor("moe.keep", k, 1),
           SavedTensor("moe.expert_input", d * slots * copies, spec.act)]
    if amp:  # the router runs outside autocast on the fp32 norm output
        out.append(SavedTensor("moe.router_input", d, 4))
    out += [SavedTensor(f"moe.experts.{x.name}", x.per_token * slots, x.nbytes) for x in _mlp(cfg, whole)]
    out += [SavedTensor("moe.picked_outputs", k * d, spec.act), SavedTensor("moe.gates", k, 4)]
    if cfg.n_shared_experts:
        wide = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.ffn_dim)
        out += [SavedTensor(f"moe.shared_{x.name}", x.per_token, x.nbytes) for x in _mlp(wide, whole)]
    return out


def moe_layer_delta(cfg: ModelConfig, spec: ActivationSpec) -> float:
    """Bytes per token a MoE layer keeps beyond a dense layer: its block's tensors less the MLP's; under autocast
    without a shared expert, also less the 16-bit copies of the MLP input (no autocast linear reads it)."""
    if not cfg.n_experts:
        return 0.0
    delta = sum(x.bytes_per_token for x in moe_saved_tensors(cfg, spec))
    delta -= sum(x.bytes_per_token for x in _mlp(cfg, spec))
    if spec.precision.startswith("amp") and not cfg.n_shared_experts:
        up = 2 if cfg.activation == "swiglu" else 1
        delta -= cfg.d_model * spec.lin_in * up * spec.act
    return delta


def _residual_mask(cfg: ModelConfig, spec: ActivationSpec, name: str) -> list[SavedTensor]:
    return [SavedTensor(name, cfg.d_model * spec.rep, spec.mask)] if cfg.dropout > 0 else []


def layer_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, *, selective: bool = False) -> list[SavedTensor]:
    """Everything one layer keeps for backward, per token, when it is not recomputed."""
    spec.validate()
    h = cfg.d_model
    attn = _attention(cfg, spec, selective)
    mlp = _mlp(cfg, spec)
    # Under autocast each linear casts its fp32 input to 16 bits on its own (only weights are cached), so
    # q, k and v keep three copies of the same input, and SwiGLU's up and gate two.
    amp = spec.precision.startswith("amp")
    qkv = 3 if amp else 1
    up = 2 if amp and cfg.activation == "swiglu" else 1
    if cfg.norm_placement == "pre":
        return [*_norm(cfg, spec, "attn_norm"), SavedTensor("attn_norm.output", h * spec.lin_in * qkv, spec.act),
                *attn, *_residual_mask(cfg, spec, "attn.residual_dropout_mask"), *_norm(cfg, spec, "mlp_norm"),
                SavedTensor("mlp_norm.output", h * spec.lin_in * up, spec.act), *mlp,
                *_residual_mask(cfg, spec, "mlp.residual_dropout_mask")]
    # post-norm: the layer input feeds q/k/v directly; each norm sees the residual sum
    return [SavedTensor("layer.input", h * spec.lin_in * qkv, spec.act), *attn,
            *_residual_mask(cfg, spec, "attn.residual_dropout_mask"), *_norm(cfg, spec, "attn_norm"),
            SavedTensor("attn_norm.output", h * spec.lin_in * up, spec.act), *mlp,
            *_residual_mask(cfg, spec, "mlp.residual_dropout_mask"), *_norm(cfg, spec, "mlp_norm")]


def checkpointed_layer_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """A fully recomputed layer keeps only its input (torch.utils.checkpoint saves the arguments)."""
    return [SavedTensor("checkpoint.input", cfg.d_model * spec.rep, spec.residual)]


def embedding_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """First stage, before layer 0: token ids, segment ids, the embedding norm (post-norm) and dropout mask."""
    out = [SavedTensor("embedding.token_ids", 1, 8)]
    if spec.tp_size > 1:  # the vocab-parallel lookup keeps its bool "id outside my shard" mask
        out.append(SavedTensor("embedding.vocab_mask", 1, 1))
    if cfg.n_token_types:
        out.append(SavedTensor("embedding.type_ids", 1, 8))
    if cfg.norm_placement == "post":
        out += _norm(cfg, spec, "emb_norm")
    if cfg.dropout > 0:
        mask = 1 if spec.device == "cuda" else spec.residual  # the embedding sum is in the residual dtype
        out.append(SavedTensor("embedding.dropout_mask", cfg.d_model * spec.rep, mask))
    return out


def head_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """Last stage: final norm (pre-norm), the head's input, the fp32 log-softmax and the int64 targets."""
    out = _norm(cfg, spec, "final_norm") if cfg.norm_placement == "pre" else []
    out.append(SavedTensor("head.input", cfg.d_model * spec.lin_in, spec.act))
    vocab = padded_vocab(cfg.vocab_size, spec.tp_size) if spec.tp_size > 1 else cfg.vocab_size
    out += [SavedTensor("loss.log_softmax", vocab / spec.tp_size, 4), SavedTensor("loss.targets", 1, 8)]
    if spec.tp_size > 1:  # the vocab-parallel cross-entropy keeps two bool target-outside-shard masks
        out.append(SavedTensor("loss.vocab_masks", 2, 1))
    return out


def loss_backward_bytes_per_token(cfg: ModelConfig, spec: ActivationSpec) -> float:
    """Gradients the loss's backward makes while its saved log-softmax is still alive (not saved tensors).

    One process: ``F.cross_entropy(logits.float())`` is log_softmax + nll_loss; when backward starts, nll_loss's
    gradient (fp32, V per token) and log_softmax's (fp32, V) exist beside the saved fp32 log-softmax: 8V bytes.
    TP (``parallel/tp/layers._VocabParallelCrossEntropy``): the gradient is a clone of the saved fp32 softmax,
    4V/t, cast to the logits' dtype before it is returned (+2V/t for 16-bit logits). Measured on CPU in
    tests/test_planner_activations.py (8.0, 4.0 and 6.0 bytes per logit).
    """
    spec.validate()
    if spec.tp_size == 1:
        return 8.0 * cfg.vocab_size
    vocab = padded_vocab(cfg.vocab_size, spec.tp_size) / spec.tp_size
    return (4 + (2 if spec.act == 2 else 0)) * vocab


def total_bytes(tensors: list[SavedTensor], tokens: int) -> int:
    return round(sum(x.bytes_per_token for x in tensors) * tokens)


@dataclass(frozen=True)
class LayerCosts:
    """Bytes per token of one micro-batch, and the per-forward autocast weight copies, for one rank."""

    full: float  # a layer that is not recomputed
    selective: float  # a layer whose attention core is recomputed (keeps the projections' outputs instead)
    checkpointed: float  # a fully recomputed layer (its input only)
    attention_core: float  # what one layer's recomputed attention core holds while its backward runs
    embedding: float
    head: float
    loss_backward: float  # the loss's gradients at the start of the last stage's backward
    amp_layer_weights: int  # 16-bit weight copies autocast keeps per layer and micro-batch (0 unless amp_*)
    amp_head_weights: int
    moe_delta: float = 0.0  # a MoE layer's bytes per token beyond a dense layer's (moe_layer_delta)
    moe_amp_weights_delta: int = 0  # a MoE layer's autocast weight copies beyond a dense layer's


def layer_costs(cfg: ModelConfig, spec: ActivationSpec) -> LayerCosts:
    def per_token(xs: list[SavedTensor]) -> float:
        return sum(x.bytes_per_token for x in xs)

    amp_layer = amp_head = amp_moe = 0
    if spec.precision.startswith("amp"):
        t, h = spec.tp_size, cfg.d_model
        kv = cfg.kv_heads * cfg.head_dim
        kv_local = kv // t if kv_sharded(cfg, t) else kv
        mats = 3 if cfg.activation == "swiglu" else 2
        amp_layer = 2 * (2 * h * h // t + 2 * h * kv_local + mats * h * cfg.ffn_dim // t)
        amp_head = 2 * h * (padded_vocab(cfg.vocab_size, t) // t if t > 1 else cfg.vocab_size)
        # every local expert and the shared expert run (the router outside autocast), instead of the MLP shard
        experts = cfg.n_experts // spec.ep_size + cfg.n_shared_experts
        amp_moe = 2 * mats * h * cfg.ffn_dim * experts - 2 * mats * h * cfg.ffn_dim // t if cfg.n_experts else 0
    return LayerCosts(full=per_token(layer_saved_tensors(cfg, spec)),
                      selective=per_token(layer_saved_tensors(cfg, spec, selective=True)),
                      checkpointed=per_token(checkpointed_layer_saved_tensors(cfg, spec)),
                      attention_core=per_token(attention_core_saved_tensors(cfg, spec)),
                      embedding=per_token(embedding_saved_tensors(cfg, spec)),
                      head=per_token(head_saved_tensors(cfg, spec)),
                      loss_backward=loss_backward_bytes_per_token(cfg, spec),
                      amp_layer_weights=amp_layer, amp_head_weights=amp_head,
                      moe_delta=moe_layer_delta(cfg, spec), moe_amp_weights_delta=amp_moe)


def stage_activations(costs: LayerCosts, *, mode: str, every: int, layer_ids: Sequence[int], tokens: int,
                      first: bool, last: bool, in_flight: float, moe_ids: Collection[int] = ()) -> dict[str, int]:
    """Activation terms of one pipeline stage at its peak, in bytes.

    ``saved``: what the autograd graph holds for ``in_flight`` micro-batches (the saved-tensor-hook figure);
    ``amp_weight_copies``: autocast's 16-bit weight casts held by the graph (not made inside recomputed layers);
    ``backward_working_set``: the larger of two transients of one micro-batch's backward that never coexist:
    the loss's gradients on the last stage (``loss_backward_bytes_per_token``: its backward ends before the
    first layer's starts) and one recomputed layer's full saved tensors (selective: its attention core), alive
    while that layer's backward runs. ``moe_ids``: the MoE layers among ``layer_ids`` (``costs.moe_delta`` more).
    """
    if mode not in RECOMPUTE:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(RECOMPUTE)}")
    if mode == "full":
        ckpt = set(layer_ids)
    elif mode == "every_k":
        ckpt = {i for i in layer_ids if i % every == 0}
    else:
        ckpt = set()
    n_ckpt = len(ckpt)
    n_plain = len(layer_ids) - n_ckpt
    moe_plain = sum(1 for i in layer_ids if i in moe_ids and i not in ckpt)
    per_layer = costs.selective if mode == "selective" else costs.full
    per_token = n_ckpt * costs.checkpointed + n_plain * per_layer + moe_plain * costs.moe_delta
    per_token += (costs.embedding if first else 0.0) + (costs.head if last else 0.0)
    weights = n_plain * costs.amp_layer_weights + moe_plain * costs.moe_amp_weights_delta
    weights += costs.amp_head_weights if last else 0
    recompute = costs.full + (costs.moe_delta if ckpt & set(moe_ids) else 0.0) if n_ckpt else (
        costs.attention_core if mode == "selective" and layer_ids else 0.0)
    return {
        "saved": round(per_token * tokens * in_flight),
        "amp_weight_copies": round(weights * in_flight),
        "backward_working_set": round(max(recompute, costs.loss_backward if last else 0.0) * tokens),
    }


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Megatron's per-layer activation bytes, Korthikanti et al. 2022, Table 2 (the published reference)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attn_core = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + attn_core)
    if t > 1:
        return s * b * h * (10 + 24 / t + attn_core)
    return s * b * h * (34 + attn_core)


def in_flight_microbatches(schedule: str, *, pp_size: int, pp_rank: int, n_microbatches: int,
                           virtual_stages: int = 1) -> float:
    """Micro-batches of this stage's layers whose activations are alive at the peak.

    GPipe runs every forward first: m. 1F1B (Narayanan et al. 2021, section 2.2) and ZB-H1 warm up with
    p - r forwards: min(m, p - r). Interleaved 1F1B (Megatron's schedule): rank r warms up
    2(p - r - 1) + (v - 1)p model chunks, +1 in the steady state; chunks of L/(p v) layers, so rank 0 holds
    L(1 + (p - 1)/(p v)) layers' worth (Korthikanti et al. 2022, section 4.2.3). Returned in units of the
    stage's whole layer set (p*v chunks of L/(p*v) = p*(1 + (p-1)/(p*v)) for rank 0).
    """
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
    p, r, m, v = pp_size, pp_rank, n_microbatches, virtual_stages
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        chunks = min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
        return chunks / v
    return float(min(m, p - r))
